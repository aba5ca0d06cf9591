"""What libraries ask of the tensors they are given, answered as on the GPU.

Hugging Face transformers' `is_tracing(t)` is true for a FakeTensor, and a model traced under
fake tensors then takes the branches it takes under torch.export. Where a real step with no
padding and no cache (`use_cache=False`, as `gradient_checkpointing_enable` sets) passes
`is_causal=True` to SDPA, the traced one skips its packed-sequence check, builds an explicit
mask, and SDPA runs the masked kernel over the whole square instead of the causal half (a
checkpointed Llama-3.2-1B's attention predicted at 2.5x the GPU's time:
benchmarks/results/zoo_profile_gc_h100.json). Within `real_to_libraries`, a fake tensor whose
value checks the trace can answer (`assume.Values.answerable`) is shown to such a library as
real, and the checks it then makes are read by `capture.assume`, each answer named; any
other tensor (a mask from the user's batch whose values the trace does not hold) stays
"traced", and the library builds the explicit mask a padded batch needs on the GPU too.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

#: (module, function): the libraries' tests of whether a tensor is fake
_FAKE_TESTS = (("transformers.utils.import_utils", "is_fake_tensor"),)


@contextlib.contextmanager
def real_to_libraries(answerable: Callable[[Any], bool]) -> Iterator[None]:
    """Within this context, the libraries already imported see as real the fake tensors
    `answerable` accepts (see above)."""
    saved = []
    for module_name, attr in _FAKE_TESTS:
        module = sys.modules.get(module_name)
        test = getattr(module, attr, None) if module is not None else None
        if callable(test):
            saved.append((module, attr, test))
            setattr(module, attr, lambda x, test=test: test(x) and not answerable(x))
    try:
        yield
    finally:
        for module, attr, fn in saved:
            setattr(module, attr, fn)

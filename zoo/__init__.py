"""The workloads gobrrr's recorded GPU results were measured on, and the CPU code that reads
those recordings back: models written by others (Hugging Face transformers, torchvision,
timm) trained as their users train them (`cases`, `hf`, `vision`, `common`), the errors of
gobrrr's predictions against the recordings (`compare`), the planner's scenarios
(`scenarios`), the compiled-step cases (`compiled`), the allocator's test sequences
(`allocator_sequences`), the offload configurations (`offload`) and the compact allocator
trace (`allocdiff`).

A package at the repository's root, not under benchmarks/, because both import it: the GPU
scripts in benchmarks/ to measure these workloads, and the tests to predict them again on the
CPU against the recordings in tests/fixtures/. Run from the repository root (or with it on
PYTHONPATH):

    from zoo.cases import CASES, get_case
"""

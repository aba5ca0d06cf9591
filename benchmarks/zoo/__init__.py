"""Models written by others (Hugging Face transformers, torchvision, timm), trained as their
users train them: the fidelity set that gobrrr's predictions are held against.

    from zoo.cases import CASES, get_case      # with benchmarks/ on sys.path
"""

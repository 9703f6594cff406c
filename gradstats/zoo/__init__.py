"""The built-in testbed: small models (plain ``torch.nn``), the offline datasets, and the training loop
that the demo, the command line and the experiments use. Not a stage of the data flow: it is what the
flow is exercised on (any ``nn.Module`` can be traced).

Example:
    >>> from gradstats import zoo
    >>> zoo.list_models()[:2]
    ['cnn', 'lstm']
"""
from __future__ import annotations

from gradstats.zoo.data import data_dir, load_data, load_digits, load_fashion_mnist, load_images, load_shakespeare
from gradstats.zoo.models import build_model, example_input, list_models
from gradstats.zoo.training import TrainResult, evaluate, prepare, train

__all__ = ["build_model", "list_models", "example_input", "load_fashion_mnist", "load_digits", "load_images",
           "load_shakespeare", "load_data", "data_dir", "train", "evaluate", "prepare", "TrainResult"]

"""Evaluation of speculative-decoding draft models.

``simulated_acceptance_length`` and ``Evaluator`` turn per-position accept counts into
metrics (summed over batches and ranks, never averaged); ``EvalConfig`` names what an
eval pass measures and ``EvalCache`` keeps one directory of artifacts per such identity.
Depends on torch and the standard library only.
"""

from eval._cache import EvalCache
from eval._config import EvalConfig
from eval._errors import EvalError
from eval._evaluator import Evaluator
from eval._metrics import simulated_acceptance_length

__all__ = [
    "EvalCache",
    "EvalConfig",
    "EvalError",
    "Evaluator",
    "simulated_acceptance_length",
]

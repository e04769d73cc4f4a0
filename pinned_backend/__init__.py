"""stackpin's local inference server: a batch-invariant replica that loads real checkpoints.

The model side lives in checkpoint.py (config and weights), tokenizer.py, model.py, kvcache.py and kernels/;
tiny.py makes the small model the embedded default serves. Scheduling, sampling, HTTP and the stack's
self-description live in their own modules and reach the model only through `Transformer.forward`.
"""

__version__ = "0.1.0"

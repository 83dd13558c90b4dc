"""The CPU demo: a character tokenizer, the 3-digit addition task and local makers of tiny Qwen3 models.

Submodules import torch/transformers lazily, so `vime.demo.arithmetic` stays cheap for the broker and
the reward worker.
"""

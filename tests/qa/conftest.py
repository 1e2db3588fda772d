"""QA tests drive the product as users do: tiny models and one intra-op thread (a shared
2-core box); accelerate's singletons are reset by tests/conftest.py."""

from __future__ import annotations

import torch

torch.set_num_threads(1)

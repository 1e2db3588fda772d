"""Fault tests run tiny models: one intra-op thread avoids spin-waiting on a shared box."""

import torch

torch.set_num_threads(1)

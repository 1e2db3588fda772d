"""`lazytrain demo`: fine-tune a small model end to end here (docs/getting_started.md)."""

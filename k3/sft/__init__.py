"""Supervised fine-tuning on XTML conversations (`k3 sft`): data reading and checking, assistant-only
loss masks, packing, generated instruction-following items, the trainer hooks and the built-in
behavioural evaluation. See docs/sft.md."""

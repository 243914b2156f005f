"""Supervised warm start and rejection-sampling fine-tuning."""

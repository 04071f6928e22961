"""Accelerate programs run twice: under Hugging Face Accelerate, and under nbaccel with the
import changed (``tests/multiprocess/test_accelerate_parity.py`` compares their numbers)."""

"""The parent-side launcher (never imports torch) and the worker bootstrap it forks."""

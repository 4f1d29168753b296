"""Time as components see it: the injected `Clock` (`clock`) and the one rule that thins a
request's inter-token gaps (`gaps`).

The name does not shadow the standard library's `time`: imports are absolute, and `time` is a
built-in module, found before any path entry.
"""

"""Training invariants (issue 17): facts of each step from what bitguard recorded (facts.py),
relation templates (templates.py), inference with preconditions from clean runs (infer.py) and
checking any run, offline or online (check.py). Nothing here records or serves."""

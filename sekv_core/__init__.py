"""sekv core: everything but the command line.

Data path, one module per stage: documents -> prompt -> prefill -> methods/* (compress)
-> pack -> session (load) -> runtime (attention hook) -> methods/* (attend) -> generate.
"""

__version__ = "0.1.0"

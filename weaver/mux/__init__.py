"""Colocated models taking turns on one set of devices (MuxServe, Mux-Temporal).

``turns`` holds the rule that picks whose step runs next; ``table`` the shared file through
which the engines of one group apply it across processes.
"""

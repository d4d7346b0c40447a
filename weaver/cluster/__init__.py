"""Weaver across nodes: a cluster file of node groups (spec.py), written from a plan
(from_plan.py), deployed on Ray Serve (ray_app.py, needs the `ray` extra)."""

"""Ahead-of-time planning: `python -m launch.plan` compiles every stage's programs for a config's
mesh without weights (launch/plan/targets.py holds the planner and says what it does)."""

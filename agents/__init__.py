"""Inner-loop roles (implementer, judge, evaluator, planner) and their backends."""

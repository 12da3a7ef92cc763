"""The one error the planner raises: the inventory cannot be planned."""


class EpdPlanError(ValueError):
    """The inventory cannot be planned; the message says what to change."""

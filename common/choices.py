"""Django choices for the core's state enums (``kvsp.states``): a model's choices are the
values the core's transition tables use, spelled in one place."""

from __future__ import annotations

from enum import StrEnum

from django.db import models


def choices_of(states: type[StrEnum]) -> type[models.TextChoices]:
    """The TextChoices of ``states``: the same members and values, labelled by their names."""
    return models.TextChoices(states.__name__, [(state.name, state.value) for state in states])

"""The torch-free library every stage shares (see :mod:`perception`): it imports nothing from
:mod:`perception.robot` and names no higher package."""

"""An attempt's outcome: what the robot reports after a grasp (``../shared/CONTRACT.md`` section 7).

An outcome is a JSON object. ``success`` (``true``/``false``) says whether the grasp lifted an object.
The robot may add what it measured during the grasp. Each field is optional: absent or ``null``
means "not known".

``contact_stop`` (bool)
    the descent stopped on contact before it reached the grasp's ``z``.
``fingertip_z`` (metres in ``B``)
    the fingertip height where the descent ended: the answered ``z``, or where it stopped.
    A stop is a measured height. It is the highest surface under either finger's footprint
    (the maximum over two footprints, not a point). A descent that reached ``z`` is only a bound:
    nothing under the footprints stood above ``z``.
``jaw_width`` (metres)
    the opening after closing, before the lift. Well above 0 means that a part stood between the
    pads at that height. Near 0 means that the jaws closed on nothing.

The checks (:func:`parse_outcome`):

- an integer is a number;
- NaN, Infinity, a string, or a value out of its range is refused:
  - ``fingertip_z`` must be within [``table_z`` - 0.05, ``table_z`` + 1.0];
  - ``jaw_width`` must be within [-0.005, 0.1] (a closed jaw reads a little below 0);
- keys this module does not know are kept as given.

Torch-free: the robot side (the service, the loop) and the fine-tune read the same rules.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["MEASURED_FIELDS", "OutcomeError", "parse_outcome", "check_measured", "measured", "FINGERTIP_Z_RANGE_M", "JAW_WIDTH_RANGE_M"]

#: The optional fields a robot may measure during a grasp (contract section 7).
MEASURED_FIELDS = ("contact_stop", "fingertip_z", "jaw_width")
#: Metres relative to ``table_z``: where a fingertip can be at the end of a descent (a stop below the table is
#: an encoder or frame error; a metre above it is not a descent).
FINGERTIP_Z_RANGE_M = (-0.05, 1.0)
#: Metres: a parallel-jaw opening. A jaw closed on nothing reads a little below 0 (encoder offsets,
#: fingers pressed past their stop: the validation cells send -0.1 mm and less, and refusing them lost a
#: third of the outcomes, every closed-on-nothing failure); 5 mm below 0 is no reading of a closed jaw.
JAW_WIDTH_RANGE_M = (-0.005, 0.1)


class OutcomeError(ValueError):
    """A malformed outcome: the service answers it ``422``, the loop refuses the robot's report."""


def _number(name: str, value: Any, low: float, high: float) -> None:
    """Refuse ``value`` unless it is null or a finite number (int or float) within ``[low, high]``."""
    if value is None:
        return
    # bool is an int in Python, and true is not a height.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise OutcomeError(f"{name} must be a number (metres) or null, got {value!r}")
    try:
        x = float(value)
    except OverflowError:  # an integer of a thousand digits
        raise OutcomeError(f"{name} must be a finite number (metres), got an integer too large for one") from None
    if not math.isfinite(x):
        raise OutcomeError(f"{name} must be a finite number (metres), got {value!r}")
    if not low <= x <= high:
        raise OutcomeError(f"{name} must be within [{low:.3f}, {high:.3f}] m, got {x:g}")


def parse_outcome(obj: dict, table_z: float | None) -> dict[str, Any]:
    """Check a reported outcome (``success`` and the optional measured fields), as a dict to store.

    Args:
        obj: the outcome as received, ``attempt_id`` excluded or not (it is not part of what is stored).
        table_z: the calibration's table height in ``B``, metres: ``fingertip_z``'s range is relative to it
            (``None``: the range is not checked, only the type; a robot driver that does not know ``table_z``).

    Returns:
        every key of ``obj`` but ``attempt_id``, as given (integers stay integers, unknown keys are kept).

    Raises:
        OutcomeError: ``success`` is not a bool, or a measured field is of the wrong type, not finite, or
            out of range.
    """
    if not isinstance(obj, dict):
        raise OutcomeError('an outcome must be an object {"attempt_id": "...", "success": true|false}')
    success = obj.get("success")
    if not isinstance(success, bool):
        raise OutcomeError(f"success must be true or false, got {success!r}")
    check_measured(obj, table_z)
    return {k: v for k, v in obj.items() if k != "attempt_id"}


def check_measured(obj: dict, table_z: float | None) -> None:
    """Check the measured fields of ``obj`` (:func:`parse_outcome`'s rules, ``success`` aside).

    Raises:
        OutcomeError: a measured field of the wrong type, not finite, or out of range.
    """
    stop = obj.get("contact_stop")
    if stop is not None and not isinstance(stop, bool):
        raise OutcomeError(f"contact_stop must be true, false or null, got {stop!r}")
    if table_z is None:
        _number("fingertip_z", obj.get("fingertip_z"), -math.inf, math.inf)
    else:
        _number("fingertip_z", obj.get("fingertip_z"), table_z + FINGERTIP_Z_RANGE_M[0],
                table_z + FINGERTIP_Z_RANGE_M[1])
    _number("jaw_width", obj.get("jaw_width"), *JAW_WIDTH_RANGE_M)


def measured(outcome: dict | None) -> dict[str, Any]:
    """The measured fields an outcome carries, absent and ``null`` ones left out (``{}``: none known;
    a recording made before the fields existed)."""
    if not outcome:
        return {}
    return {k: outcome[k] for k in MEASURED_FIELDS if outcome.get(k) is not None}

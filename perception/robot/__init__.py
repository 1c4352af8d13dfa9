"""The robot applications (see :mod:`perception`): ``sim2real-serve``, ``sim2real-grasp-loop``,
``sim2real-capture``, ``sim2real-calibrate``, the camera drivers and the robot adapters, on
top of :mod:`perception.core`."""

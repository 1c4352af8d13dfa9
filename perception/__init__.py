"""The robot-side, torch-free package, in two floors.

- :mod:`perception.core`: the library every stage shares (frames and units, calibration,
  camera geometry, grasp encoding, preprocessing, the grasp rule, decoding, the artifact and
  its runner, image and JSON files, atomic writes, the command-line plumbing).
- :mod:`perception.robot`: the robot applications on top of it (the grasp service, the
  grasp loop, capture, calibration tools, camera drivers, robot adapters).

Everything here uses numpy and OpenCV only, so the robot computer can run the exported ONNX
policy without the training stack. Frames and units follow ``docs/robot_cell.md`` section 1
and are stated once, in :mod:`perception.core.frames`. The core imports nothing from the
robot floor, and neither floor names a higher package: what ``sim_render`` adds (the
simulated camera and robot) it registers itself (:mod:`perception.robot.plugins`).
"""

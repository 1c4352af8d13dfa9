"""Robot-side, torch-free layer: calibration, camera geometry, grasp encoding,
preprocessing and (later) camera drivers and the grasp service.

Everything here uses numpy and OpenCV only, so the robot computer can run the
exported ONNX policy without the training stack.  Frames and units follow
``docs/robot_cell.md`` section 1 and are stated once, in :mod:`perception.frames`.
"""

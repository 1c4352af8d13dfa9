"""The types of the configs whose values carry units: structured configs the YAML starts from.

``conf/render/randomized.yaml`` (and through it every render profile) starts from
:class:`RenderProfile`, ``conf/policy/default.yaml`` from :class:`PolicyConfig`. The YAML
is the one source of every value, its unit and its meaning; a schema says only what type
each key holds, so that Hydra refuses, when it composes, a key that is not there (a typo in
a file or on the command line) and a value of the wrong type
(``render.grasps.n_random=many``, ``policy.view.margin=wide``). A key the YAML must set has
no default here (``MISSING``): one it forgets is reported as missing, not filled in from
Python. Only keys that may be null (a section switched off, an optional option) default to
null.

Types alone check no ranges. A render range ``[lo, hi]`` (or a scalar, the degenerate
range, ``sim_render.sensor.draw_range``) is typed ``Any``, and every range and probability
is checked by ``sim_render.randomization.validate_profile`` (lo <= hi, bounds, known kinds
and families), which each renderer runs before its first scene; the policy's values by
``policies.train.check_policy_config`` before training and by the artifact loader.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

__all__ = ["SCHEMA", "PolicyConfig", "RenderProfile", "register", "section_problems"]

#: A schema's name in its group (``render``, ``policy``): the first default of the YAML that starts from it.
SCHEMA = "schema"

# A range [lo, hi] with its unit (conf/render/randomized.yaml), or a scalar: checked by
# validate_profile, not by its type (OmegaConf has no union of a number and a list).
Range = Any

# A section that a profile may switch off with null. Typed Any, not Optional[<its dataclass>]:
# OmegaConf 2.3 cannot merge a mapping into a null structured node, so a command line that
# switches one on (render=target 'render.bin_walls={height: [0.03, 0.06], thickness: [0.01, 0.01]}')
# would fail with an AttributeError. validate_profile checks these sections' keys and ranges;
# their dataclasses below type them when they are on (section_problems).
Switchable = Any


@dataclass
class BinWalls:
    height: Range = MISSING
    thickness: Range = MISSING


@dataclass
class Physics:
    timestep: float = MISSING
    solver_iterations: int = MISSING
    settle_steps: int = MISSING
    lateral_friction: Range = MISSING
    spinning_friction: Range = MISSING
    table_friction: Range = MISSING
    mass: Range = MISSING
    restitution: Range = MISSING
    gripper_force: Range = MISSING
    finger_friction: Range = MISSING


@dataclass
class Grasps:
    n_heuristic: int = MISSING
    n_random: int = MISSING
    n_perturbed: int = MISSING
    approach_height: float = MISSING
    descend_steps: int = MISSING
    close_steps: int = MISSING
    lift_steps: int = MISSING
    hold_steps: int = MISSING


@dataclass
class CameraJitter:
    position_jitter: float = MISSING
    rotation_jitter: float = MISSING
    focal_jitter: float = MISSING
    principal_jitter: float = MISSING
    distortion_jitter: float = MISSING


@dataclass
class CastShadow:
    prob: float = MISSING
    light_left: Range = MISSING
    penumbra: Range = MISSING
    resolution: float = MISSING
    max_rise: float = MISSING


@dataclass
class Lighting:
    azimuth: Range = MISSING
    elevation: Range = MISSING
    color: list[Range] = MISSING
    distance: Range = MISSING
    ambient: Range = MISSING
    diffuse: Range = MISSING
    specular: Range = MISSING
    shadow_prob: float = MISSING
    cast_shadow: Switchable = None  # CastShadow


@dataclass
class SurfaceTexture:
    prob: float = MISSING
    kinds: list[str] = MISSING
    tint: float = MISSING


@dataclass
class Textures:
    size: int = MISSING
    variants_per_kind: int = MISSING
    table: SurfaceTexture = MISSING
    bin: SurfaceTexture = MISSING
    objects: SurfaceTexture = MISSING
    distractors: SurfaceTexture = MISSING


@dataclass
class Prob:
    prob: float = MISSING


@dataclass
class SurfaceTextures:
    size: int = MISSING
    tile: Range = MISSING
    contrast: Range = MISSING
    hue_spread: float = MISSING
    accent_prob: float = MISSING
    table: Prob = MISSING
    bin: Prob = MISSING
    floor: Prob = MISSING
    objects: Prob = MISSING
    held_out: list[str] | None = None  # optional where the reader is (sim_render/surfaces.py): none held out
    # An open set: each family's parameters are its generator's (sim_render/surfaces.py checks them).
    families: dict[str, Any] = MISSING


@dataclass
class SurfaceColors:
    palette: list[Any] = MISSING  # [r, g, b] fractions each
    palette_jitter: float = MISSING
    hue: Range = MISSING
    saturation: Range = MISSING
    value: Range = MISSING
    specular: Range = MISSING


@dataclass
class Colors:
    table: SurfaceColors = MISSING
    bin: SurfaceColors = MISSING
    objects: SurfaceColors = MISSING
    distractors: SurfaceColors = MISSING


@dataclass
class Sensor:
    white_balance_r: Range = MISSING
    white_balance_b: Range = MISSING
    gamma: Range = MISSING
    contrast: Range = MISSING
    saturation: Range = MISSING
    vignetting: Range = MISSING
    blur_prob: float = MISSING
    defocus_sigma: Range = MISSING
    motion_length: Range = MISSING
    read_noise: Range = MISSING
    shot_noise: Range = MISSING
    jpeg_prob: float = MISSING
    jpeg_quality: Range = MISSING
    bayer_prob: float = MISSING
    sharpen: Range = MISSING
    sharpen_sigma: Range = MISSING


@dataclass
class Distractors:
    count: Range = MISSING
    shapes: list[str] = MISSING
    size: Range = MISSING
    clearance: float = MISSING
    band: float = MISSING
    occlusion_height: float = MISSING


@dataclass
class RenderProfile:
    """One render profile (``conf/render/*.yaml``): the twin's randomization and physics."""

    name: str = MISSING
    object_split: str = MISSING
    objects_per_scene: Range = MISSING
    bin_walls: Switchable = None  # BinWalls
    empty_scene_prob: float = MISSING
    resolution_scale: float = MISSING
    frames_per_scene: int = MISSING
    render_margin: float = MISSING
    renderer: str = MISSING
    physics: Physics = field(default_factory=Physics)
    grasps: Grasps = field(default_factory=Grasps)
    camera: CameraJitter = field(default_factory=CameraJitter)
    lighting: Lighting = field(default_factory=Lighting)
    textures: Textures = field(default_factory=Textures)
    surface_textures: Switchable = None  # SurfaceTextures
    colors: Colors = field(default_factory=Colors)
    sensor: Sensor = field(default_factory=Sensor)
    distractors: Distractors = field(default_factory=Distractors)


# ------------------------------------------------------------------------------- policy
@dataclass
class GeometryDecode:
    part_threshold: float = MISSING
    interior_margin: float | None = None
    floor_height: float | None = None


@dataclass
class View:
    kind: str = MISSING
    margin: float = MISSING
    plane_height: float = MISSING


@dataclass
class Decode:
    neighbourhood_px: int = MISSING
    width_margin: float = MISSING
    on_part_px: int | None = None
    fingers_clear: float | None = None
    jaws_on_part: float | None = None
    sweep_depth: float | None = None
    part_centre: float | None = None
    rule: Any = None  # an options mapping or null: perception/core/rule.py checks its keys
    rule_first: float | None = None
    answer_on_parts: bool = False
    guarded_descent: bool = False
    unseen_standing: bool = False


@dataclass
class Network:
    _target_: str = "policies.networks.GraspNet"  # the class (policies.networks.build_network)
    base_channels: int = MISSING
    dilations: list[int] = MISSING


@dataclass
class Targets:
    label_radius: float = MISSING
    dense_negative_labels: list[int] = MISSING
    label_height_weight: float = MISSING
    object_height_weight: float = MISSING
    angle_spread: int = MISSING
    angle_spread_weight: float = MISSING
    height_target: str = MISSING
    stability_tol: float = MISSING
    geometric_weight: float = MISSING
    geometric_max_cells: int = MISSING


@dataclass
class Augment:
    hflip: float = MISSING
    shift_px: int = MISSING
    color: float = MISSING


@dataclass
class Loss:
    quality_weight: float = MISSING
    pos_weight: float = MISSING
    dense_negative_weight: float = MISSING
    object_negative_weight: float = MISSING
    height_weight: float = MISSING
    surface_weight: float = MISSING
    width_weight: float = MISSING
    height_trust_sigma: float = MISSING
    height_trust_after: int = MISSING


@dataclass
class Optim:
    _target_: str = "torch.optim.AdamW"  # the optimizer class (policies.module.TimedCosineModule)
    lr: float = MISSING
    weight_decay: float = MISSING
    scheduler: str = MISSING
    warmup_steps: int = MISSING


@dataclass
class PolicyConfig:
    """The grasp policy (``conf/policy/*.yaml``): network, view, decode, targets, losses, optimisation."""

    name: str = MISSING
    view_size: list[int] = MISSING
    base: str | None = None
    geometry: str | None = None
    geometry_decode: GeometryDecode = field(default_factory=GeometryDecode)
    view: View = field(default_factory=View)
    angle_bins: int = MISSING
    quality_threshold: float = MISSING
    flip_average: bool = MISSING
    decode: Decode = field(default_factory=Decode)
    network: Network = field(default_factory=Network)
    targets: Targets = field(default_factory=Targets)
    augment: Any = None  # Augment, or null: no augmentation (Any: see Switchable)
    loss: Loss = field(default_factory=Loss)
    optim: Optim = field(default_factory=Optim)
    batch_size: int = MISSING
    num_workers: int = MISSING
    cache: bool = MISSING
    translate_fraction: float = MISSING
    val_fraction: float = MISSING
    keep_best_by: str | None = None
    max_steps: int = MISSING
    max_time_s: float | None = None
    val_every_n_steps: int = MISSING
    # Lightning's own types: a fraction (float) or a count of batches (int); 1, "auto", [0, 1];
    # "32-true" or 32: kept as written, so an int is not turned into a fraction.
    limit_val_batches: Any = MISSING
    accelerator: str = MISSING
    devices: Any = MISSING
    precision: Any = MISSING
    num_threads: int | None = None
    log_every_n_steps: int = MISSING


def section_problems(schema: type, value: Any, where: str, partial: bool = False) -> list[str]:
    """Check a switchable section that is on (``value`` not null) against its dataclass:
    ``[]``, or one message naming ``where`` and the key that is unknown or of the wrong type,
    or the keys it lacks (``partial``: a section whose reader fills the rest from conf/ may
    lack keys). Ranges are the caller's to check."""

    try:
        typed = OmegaConf.merge(OmegaConf.structured(schema), value)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or getattr(exc, "key", None)
        first = str(exc).splitlines()[0]
        return [f"{where}.{key}: {first}" if key else f"{where}: {first}"]
    missing = [] if partial else sorted(OmegaConf.missing_keys(typed))
    return [f"{where} lacks {missing}"] if missing else []


def register() -> None:
    """Store the schemas in Hydra's ``ConfigStore`` (groups ``render`` and ``policy``); idempotent."""

    store = ConfigStore.instance()
    store.store(group="render", name=SCHEMA, node=RenderProfile)
    store.store(group="policy", name=SCHEMA, node=PolicyConfig)

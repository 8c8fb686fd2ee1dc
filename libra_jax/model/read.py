"""Reading a profile: validation of its JSON document (every missing or malformed field named
by its dotted path), and where a profile is found (the shipped ones, a calibrated one, a path).
"""
from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from libra_jax import config
from libra_jax.collectives import ROWS
from libra_jax.model.forms import FORM_TABLE
from libra_jax.model.profile import (
    BYTES_PER_GBIT,
    BYTES_PER_GBYTE,
    FLOP_PER_TFLOP,
    FORMS,
    PROFILE_DIR,
    S_PER_MS,
    S_PER_US,
    SCHEMA_CHANGES,
    SCHEMA_VERSION,
    SOURCES,
    DeviceSpec,
    FairShare,
    LibraFit,
    NcclStyle,
    NetworkSpec,
    Profile,
    Quantity,
)


def _finite(value: int | float) -> bool:
    """Finite as a float: JSON's integers are unbounded, and 10**400 is no float."""
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:40] + f"... ({len(text)} characters)"


class _Reader:
    """Walks the JSON document; every error names the dotted field path and the profile."""

    def __init__(self, origin: str) -> None:
        self.origin = origin
        self.sources: dict[str, Quantity] = {}

    def fail(self, path: str, problem: str) -> ValueError:
        return ValueError(f"profile {self.origin}: field '{path}' {problem}")

    def section(self, data: Mapping[str, Any], key: str, prefix: str = "",
                allowed: Iterable[str] | None = None) -> Mapping[str, Any]:
        path = prefix + key
        if key not in data:
            raise self.fail(path, "is missing")
        value = data[key]
        if not isinstance(value, Mapping):
            raise self.fail(path, f"must be an object, got {type(value).__name__}")
        if allowed is not None:
            self.no_unknown(value, path + ".", allowed)
        return value

    def no_unknown(self, data: Mapping[str, Any], prefix: str, allowed: Iterable[str]) -> None:
        allowed = set(allowed) | {"note", "notes", "ref"}
        for key in data:
            if key not in allowed and not key.startswith("_"):
                raise self.fail(prefix + key, f"is not a known field (expected one of {', '.join(sorted(allowed))})")

    def text(self, data: Mapping[str, Any], key: str, prefix: str = "", choices: Iterable[str] | None = None) -> str:
        path = prefix + key
        if key not in data:
            raise self.fail(path, "is missing")
        value = data[key]
        if not isinstance(value, str) or not value:
            raise self.fail(path, f"must be a non-empty string, got {value!r}")
        if choices is not None and value not in choices:
            raise self.fail(path, f"must be one of {', '.join(choices)}, got {value!r}")
        return value

    def quantity(self, data: Mapping[str, Any], key: str, prefix: str = "") -> Quantity:
        path = prefix + key
        if key not in data:
            raise self.fail(path, "is missing")
        q = data[key]
        if not isinstance(q, Mapping):
            raise self.fail(path, 'must be an object {"value": ..., "source": ...}, '
                            f"got {type(q).__name__}")
        self.no_unknown(q, path + ".", ("value", "source"))
        if "value" not in q:
            raise self.fail(path + ".value", "is missing")
        if "source" not in q:
            raise self.fail(path + ".source", "is missing")
        if q["source"] not in SOURCES:
            raise self.fail(path + ".source", f"must be one of {', '.join(SOURCES)}, got {q['source']!r}")
        ref = q.get("ref", "")
        quantity = Quantity(q["value"], q["source"], ref if isinstance(ref, str) else "")
        self.sources[path] = quantity
        return quantity

    def number(self, data: Mapping[str, Any], key: str, prefix: str = "", *, minimum: float = 0.0,
               inclusive: bool = False, maximum: float | None = None) -> float:
        """A finite number ``> minimum`` (``>=`` when inclusive) and ``<= maximum``."""
        path = prefix + key
        value = self.quantity(data, key, prefix).value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
            raise self.fail(path + ".value", f"must be a finite number, got {_short(value)}")
        if value < minimum or (value == minimum and not inclusive):
            bound = ">=" if inclusive else ">"
            raise self.fail(path + ".value", f"must be {bound} {minimum}, got {value!r}")
        if maximum is not None and value > maximum:
            raise self.fail(path + ".value", f"must be <= {maximum}, got {value!r}")
        return float(value)

    def integer(self, data: Mapping[str, Any], key: str, prefix: str = "", *, minimum: int = 1) -> int:
        path = prefix + key
        value = self.quantity(data, key, prefix).value
        if (isinstance(value, bool) or not isinstance(value, int) or value < minimum
                or not _finite(value)):
            raise self.fail(path + ".value", f"must be an integer >= {minimum} (and a float's "
                            f"range), got {_short(value)}")
        return value

    def options(self, data: Mapping[str, Any], key: str, prefix: str = "") -> tuple[int, ...]:
        path = prefix + key
        value = self.quantity(data, key, prefix).value
        if (not isinstance(value, list) or not value
                or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 or not _finite(v)
                       for v in value)):
            raise self.fail(path + ".value", "must be a non-empty list of positive integers, "
                            f"got {_short(value)}")
        if sorted(set(value)) != value:
            raise self.fail(path + ".value", f"must be strictly increasing, got {value!r}")
        return tuple(value)


def _read_bw_fit(r: _Reader, section: Mapping[str, Any], key: str, prefix: str) -> tuple[float, float, float, float]:
    fit = r.section(section, key, prefix, ("a_mib_per_ms", "b_mib_per_ms", "c", "thread_exponent"))
    p = f"{prefix}{key}."
    return (r.number(fit, "a_mib_per_ms", p), r.number(fit, "b_mib_per_ms", p), r.number(fit, "c", p),
            r.number(fit, "thread_exponent", p))


# The fields the block-count forms (fair-share, nccl-style) share.
_BLOCK_FORM_KEYS = ("block_options", "threads_per_block", "per_block_gbyte_per_s", "softmin_p",
                    "fusion_copy_gbyte_per_s", "overlap_block_efficiency", "call_us")


def _block_form_fields(r: _Reader, c: Mapping[str, Any], p: str) -> dict[str, Any]:
    """The shared fields of a block-count form, read and converted to SI units."""
    return dict(
        block_options=r.options(c, "block_options", p),
        threads_per_block=r.integer(c, "threads_per_block", p),
        per_block_bytes_per_s=r.number(c, "per_block_gbyte_per_s", p) * BYTES_PER_GBYTE,
        softmin_p=r.number(c, "softmin_p", p),
        fusion_copy_bytes_per_s=(math.inf if r.quantity(c, "fusion_copy_gbyte_per_s", p).value is None
                                 else r.number(c, "fusion_copy_gbyte_per_s", p) * BYTES_PER_GBYTE),
        overlap_block_efficiency=r.number(c, "overlap_block_efficiency", p, maximum=1.0),
        call_s=r.number(c, "call_us", p, inclusive=True) * S_PER_US,
    )


def profile_from_dict(data: Mapping[str, Any], *, origin: str = "<dict>") -> Profile:
    """Validate a parsed profile document and build a `Profile`.

    Raises ``ValueError`` naming the first missing or malformed field (dotted path) and ``origin``.
    """
    r = _Reader(origin)
    if not isinstance(data, Mapping):
        raise ValueError(f"profile {origin}: the document must be a JSON object, got {type(data).__name__}")
    r.no_unknown(data, "", ("schema_version", "name", "description", "form", "device", "network",
                            "libra_fit", "nccl_style", "fair_share", "calibration"))
    if "schema_version" not in data:
        raise r.fail("schema_version", "is missing")
    version = data["schema_version"]
    if version != SCHEMA_VERSION:
        if isinstance(version, int) and not isinstance(version, bool) and version < SCHEMA_VERSION:
            changes = "; ".join(f"{v}: {SCHEMA_CHANGES[v]}" for v in sorted(SCHEMA_CHANGES) if v > version)
            why = ("an outdated profile: re-run `libra-jax calibrate` or update it (docs/calibration.md); "
                   f"changed since: {changes}")
        elif isinstance(version, int) and not isinstance(version, bool):
            why = "written by a newer libra_jax: upgrade libra_jax or re-run `libra-jax calibrate`"
        else:
            why = "not a schema version"
        raise r.fail("schema_version", f"must be {SCHEMA_VERSION}, got {version!r} ({why})")
    if "calibration" in data and not isinstance(data["calibration"], Mapping):
        raise r.fail("calibration", f"must be an object, got {type(data['calibration']).__name__}")
    name = r.text(data, "name")
    form = r.text(data, "form", choices=FORMS)
    description = data.get("description", "")
    if not isinstance(description, str):
        raise r.fail("description", "must be a string")
    notes = data.get("notes", [])
    if not isinstance(notes, list) or not all(isinstance(n, str) for n in notes):
        raise r.fail("notes", "must be a list of strings")

    d = r.section(data, "device", allowed=("name", "compute_unit_kind", "compute_units",
                                            "peak_dense_tflop_per_s", "memory_gbyte_per_s",
                                            "compute_efficiency", "memory_efficiency", "default_dtype"))
    peaks_raw = r.section(d, "peak_dense_tflop_per_s", "device.")
    peaks = {dt: r.number(peaks_raw, dt, "device.peak_dense_tflop_per_s.") * FLOP_PER_TFLOP
             for dt in peaks_raw if dt not in ("note", "notes", "ref") and not dt.startswith("_")}
    if not peaks:
        raise r.fail("device.peak_dense_tflop_per_s", "must name at least one dtype")
    default_dtype = r.text(d, "default_dtype", "device.", choices=tuple(peaks))
    device = DeviceSpec(
        name=r.text(d, "name", "device."),
        compute_unit_kind=r.text(d, "compute_unit_kind", "device.", choices=("SM", "core")),
        compute_units=r.integer(d, "compute_units", "device."),
        peak_dense_flop_per_s=peaks,
        memory_bytes_per_s=r.number(d, "memory_gbyte_per_s", "device.") * BYTES_PER_GBYTE,
        compute_efficiency=r.number(d, "compute_efficiency", "device.", maximum=1.0),
        memory_efficiency=r.number(d, "memory_efficiency", "device.", maximum=1.0),
        default_dtype=default_dtype,
    )

    n = r.section(data, "network", allowed=("devices_per_node", "intra_node_gbyte_per_s", "nic_gbit_per_s",
                                             "base_latency_us", "intra_node_step_latency_us",
                                             "inter_node_step_latency_us"))
    network = NetworkSpec(
        devices_per_node=r.integer(n, "devices_per_node", "network."),
        intra_node_bytes_per_s=r.number(n, "intra_node_gbyte_per_s", "network.") * BYTES_PER_GBYTE,
        inter_node_bytes_per_s=r.number(n, "nic_gbit_per_s", "network.") * BYTES_PER_GBIT,
        base_latency_s=r.number(n, "base_latency_us", "network.", inclusive=True) * S_PER_US,
        intra_step_latency_s=r.number(n, "intra_node_step_latency_us", "network.", inclusive=True) * S_PER_US,
        inter_step_latency_s=r.number(n, "inter_node_step_latency_us", "network.", inclusive=True) * S_PER_US,
    )

    spec = FORM_TABLE[form]
    sections: dict[str, Any] = {f.section: None for f in FORM_TABLE.values()}
    sections[spec.section] = FORM_READERS[form](r, data)
    return Profile(name=name, origin=origin, form=form, description=description, device=device,
                   network=network, notes=tuple(notes), sources=dict(r.sources), **sections)


def _read_libra_fit(r: _Reader, data: Mapping[str, Any]) -> LibraFit:
    f = r.section(data, "libra_fit", allowed=("reference_link_gbit_per_s", "thread_options",
                                              "max_threads_per_block", "overlap_bw", "solo_bw", "slowdown"))
    s = r.section(f, "slowdown", "libra_fit.", ("scale", "intercept", "slope_per_thread"))
    return LibraFit(
        reference_link_bytes_per_s=r.number(f, "reference_link_gbit_per_s", "libra_fit.") * BYTES_PER_GBIT,
        thread_options=r.options(f, "thread_options", "libra_fit."),
        max_threads_per_block=r.integer(f, "max_threads_per_block", "libra_fit."),
        overlap_bw=_read_bw_fit(r, f, "overlap_bw", "libra_fit."),
        solo_bw=_read_bw_fit(r, f, "solo_bw", "libra_fit."),
        slowdown=(r.number(s, "scale", "libra_fit.slowdown."), r.number(s, "intercept", "libra_fit.slowdown."),
                  r.number(s, "slope_per_thread", "libra_fit.slowdown.", inclusive=True)),
    )


def _read_fair_share(r: _Reader, data: Mapping[str, Any]) -> FairShare:
    c = r.section(data, "fair_share", allowed=_BLOCK_FORM_KEYS + (
        "cores", "compute_threads", "pending_allreduce_us", "xla_allreduce_call_us",
        "xla_allreduce_gbyte_per_s", "sync_stagger_us_per_root_ms", *TRAFFIC_KEYS.values()))
    p = "fair_share."
    # Each kind's measured traffic, by its row's key (`collectives.Collective.traffic_key`).
    traffic: dict[str, Any] = {key: _optional_number(r, c, key, p) for key in TRAFFIC_KEYS.values()}
    return FairShare(
        **_block_form_fields(r, c, p),
        cores=r.number(c, "cores", p),
        compute_threads=r.number(c, "compute_threads", p),
        pending_allreduce_s=(r.number(c, "pending_allreduce_us", p, inclusive=True) * S_PER_US
                             if "pending_allreduce_us" in c else None),
        xla_call_s=(r.number(c, "xla_allreduce_call_us", p, inclusive=True) * S_PER_US
                    if "xla_allreduce_call_us" in c else None),
        xla_bytes_per_s=(r.number(c, "xla_allreduce_gbyte_per_s", p) * BYTES_PER_GBYTE
                         if "xla_allreduce_gbyte_per_s" in c else None),
        sync_stagger=(r.number(c, "sync_stagger_us_per_root_ms", p, inclusive=True) * S_PER_US
                      / S_PER_MS ** 0.5 if "sync_stagger_us_per_root_ms" in c else None),
        **traffic,
    )


def _optional_number(r: _Reader, section: Mapping[str, Any], key: str, prefix: str) -> float | None:
    return r.number(section, key, prefix) if key in section else None


#: The fair-share form's measured `collective_traffic`, by collective (its row): its field (and
#: key), from the kinds' rows (`collectives.Collective.traffic_key`).
TRAFFIC_KEYS = {row: row.traffic_key for row in ROWS if row.traffic_key is not None}


def _read_nccl_style(r: _Reader, data: Mapping[str, Any]) -> NcclStyle:
    c = r.section(data, "nccl_style", allowed=_BLOCK_FORM_KEYS + (
        "units_per_block", "memory_bytes_per_bus_byte",
        "memory_bound_fraction"))
    p = "nccl_style."
    return NcclStyle(
        **_block_form_fields(r, c, p),
        units_per_block=r.number(c, "units_per_block", p, minimum=0.0),
        memory_bytes_per_bus_byte=r.number(c, "memory_bytes_per_bus_byte", p, inclusive=True),
        memory_bound_fraction=r.number(c, "memory_bound_fraction", p, inclusive=True, maximum=1.0),
    )


#: Directory of calibrated profiles (overrides the per-user cache directory).
PROFILE_DIR_ENV = config.PROFILE_DIR_ENV
calibrated_profile_dir = config.calibrated_profile_dir


def calibrated_profile_path(backend: str) -> Path:
    """The calibrated profile of ``backend`` (``"cpu"``, ``"cuda"``): ``<dir>/<backend>.json``."""
    return calibrated_profile_dir() / f"{backend}.json"


#: Built-in profile per backend, used when the backend has not been calibrated.
BUILTIN_PROFILES = {"cpu": "cpu-host", "cuda": "h100", "gpu": "h100"}
_warned_profiles: set[str] = set()
#: Profiles held in memory, by the label `default_profile` returns for them: the shipped CPU
#: profile rescaled by this machine's probe (`libra_jax.model.probe`), one per machine key.
PROBED: dict[str, Profile] = {}


def default_profile(backend: str, builtin: str | None = None) -> str:
    """The profile ``optimize`` and ``psum(blocks=None)`` use on ``backend``: the calibrated one
    (`calibrated_profile_path`) if it exists and loads, else ``builtin`` if given, else the
    backend's shipped profile -- on CPU rescaled by this machine's probe
    (`libra_jax.model.probe.probed_default`; ``LIBRA_JAX_PROFILE_PROBE=0``: as shipped). A
    calibrated profile that does not load is skipped with a warning that says why. Returns a
    name, a path, or a probed profile's label (`PROBED`), for `load_profile`."""
    fallback = builtin or BUILTIN_PROFILES.get(backend, "cpu-host")
    path = calibrated_profile_path(backend)
    if not path.is_file():
        return _shipped_default(backend, fallback, builtin)
    text = str(path)
    try:
        _loaded(text)
    except (ValueError, OSError) as exc:
        if text not in _warned_profiles:
            _warned_profiles.add(text)
            config.notice("profile-ignored",
                          f"libra_jax: ignoring the calibrated profile {text}: {exc}; using {fallback!r}",
                          RuntimeWarning, stacklevel=2)
        return _shipped_default(backend, fallback, builtin)
    return text


#: The CPU default rescaled to this machine: `libra_jax.model.probe.probed_default`, which sets
#: it when imported (`libra_jax.model` imports it; the probe reads profiles with this module, so
#: this module does not import it). (backend, shipped name) -> the name or label to plan with.
probe_hook: Callable[[str, str], str] | None = None


def _shipped_default(backend: str, fallback: str, builtin: str | None) -> str:
    """`fallback`, the shipped profile, rescaled by the probe where `builtin` was not given."""
    if builtin is not None or probe_hook is None:
        return fallback
    return probe_hook(backend, fallback)


@functools.lru_cache(maxsize=16)
def _load_cached(path: str, mtime_ns: int) -> Profile:
    return load_profile(path)


def _loaded(name_or_path: str | os.PathLike[str]) -> Profile:
    """`load_profile`, read once per file version (path and modification time)."""
    text = os.fspath(name_or_path)
    if text in PROBED:
        return PROBED[text]
    path = Path(text)
    if not (text.endswith(".json") or path.is_file()):
        path = PROFILE_DIR / f"{text}.json"
    try:
        mtime_ns = path.stat().st_mtime_ns
    except OSError:
        return load_profile(text)  # says what is wrong with it
    return _load_cached(text, mtime_ns)


def resolve_profile(profile: Profile | str | os.PathLike[str] | Mapping[str, Any] | None,
                    backend: str | None = None, *, who: str = "libra_jax") -> Profile:
    """The one resolution of a ``profile=`` argument into a loaded `Profile`, done once
    per ``optimize`` trace, ``explain`` or lowered ``psum(blocks=None)``: a Profile is itself;
    a name or path is loaded (once per file version); a mapping is a profile's JSON document;
    None is ``backend``'s `default_profile`. Anything else is a TypeError naming `who`."""
    if isinstance(profile, Profile):
        return profile
    if isinstance(profile, Mapping):
        return profile_from_dict(profile, origin="<profile= document>")
    if isinstance(profile, (str, os.PathLike)):
        return _loaded(profile)
    if profile is None:
        if backend is None:
            raise TypeError(f"{who}: profile=None needs a backend to take the default of")
        return _loaded(default_profile(backend))
    raise TypeError(f"{who}: profile must be a profile name, a path, a model.Profile or its "
                    f"JSON document (a dict), got {type(profile).__name__}")


def profile_path(name: str) -> Path:
    """The file of the shipped profile `name`."""
    return PROFILE_DIR / f"{name}.json"


def list_profiles() -> list[str]:
    """Names of the profiles shipped with the package."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def profile_to_dict(profile: Profile) -> dict[str, Any]:
    """The JSON document of a validated profile, for ``profile_from_dict`` elsewhere (another
    process, a file): every number with its provenance, and the text fields. Measurement
    records (``calibration``) and per-field notes are not kept: nothing reads them to plan."""
    doc: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "name": profile.name,
                           "form": profile.form, "description": profile.description,
                           "notes": list(profile.notes)}
    for path, q in profile.sources.items():
        *parents, leaf = path.split(".")
        node = doc
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = {"value": q.value, "source": q.source, **({"ref": q.ref} if q.ref else {})}
    device = doc.setdefault("device", {})
    device.update(name=profile.device.name, compute_unit_kind=profile.device.compute_unit_kind,
                  default_dtype=profile.device.default_dtype)
    return doc


def load_profile(name_or_path: str | Path) -> Profile:
    """Load and validate a profile: a shipped name (``"h200"``), a path to a JSON file, or a
    probed profile's label (`default_profile`)."""
    text_arg = str(name_or_path)
    if text_arg in PROBED:
        return PROBED[text_arg]
    path = Path(text_arg)
    if not (text_arg.endswith(".json") or path.is_file()):
        path = PROFILE_DIR / f"{text_arg}.json"
        if not path.is_file():
            raise ValueError(f"unknown profile {text_arg!r}: not a file, and not one of "
                             f"{', '.join(list_profiles())}")
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise ValueError(f"profile file {str(path)!r} does not exist") from None
    except IsADirectoryError:
        raise ValueError(f"profile {str(path)!r} is a directory, not a JSON file") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"profile {str(path)!r} is not UTF-8 text: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"profile {str(path)!r} is not valid JSON: {exc}") from None
    return profile_from_dict(data, origin=repr(str(path)))


#: How each form's section is read, by form (`forms.FORM_TABLE`'s keys).
FORM_READERS: Mapping[str, Callable[[_Reader, Mapping[str, Any]], Any]] = {
    "libra-fit": _read_libra_fit, "nccl-style": _read_nccl_style, "fair-share": _read_fair_share,
}
assert tuple(FORM_READERS) == tuple(FORM_TABLE)

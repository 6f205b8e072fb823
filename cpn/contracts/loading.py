"""Read contract files (YAML or JSON) into validated models, with one-line errors.

A user who gets a field wrong sees `file: path.to[3].field: reason`, never a traceback.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from cpn.contracts.job import JobSpec
from cpn.contracts.reservations import Reservations
from cpn.contracts.topology import Topology, link_key
from cpn.errors import InputError

M = TypeVar("M", bound=BaseModel)


def read_text(path: Path) -> str:
    """A file the user named, as text: InputError (one line) when it is missing,
    unreadable or not UTF-8 — never a traceback."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 text (byte {exc.start})") from None


def _read(path: Path) -> Any:
    text = read_text(path)
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "malformed"
        raise InputError(f"{path}: not valid YAML{where}: {problem}") from None


def format_location(loc: tuple[int | str, ...]) -> str:
    """('sites', 0, 'nodes', 1, 'gpu') -> 'sites[0].nodes[1].gpu'.

    Union branches show up in pydantic locations as type names (`ParallelSpec`,
    `literal['auto']`); they mean nothing to the author of the file, so they are dropped.
    """
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part[:1].isupper() or part.startswith(("literal[", "function-")):
            continue
        else:
            out += f".{part}" if out else part
    return out


def _describe(exc: ValidationError) -> str:
    errors = exc.errors(include_url=False)
    # With a union (parallel: {..} | auto) pydantic reports one error per branch; the one
    # for the structured branch is the useful one unless the input was a plain string.
    errors.sort(key=lambda e: any(str(p).startswith("literal[") for p in e["loc"]))
    err = errors[0]
    msg = str(err["msg"])
    msg = msg.removeprefix("Value error, ").removeprefix("Assertion failed, ")
    msg = msg[:1].lower() + msg[1:]
    where = format_location(tuple(err["loc"]))
    if err["type"] not in {"missing", "value_error", "extra_forbidden"} and "input" in err:
        shown = repr(err["input"])
        if len(shown) <= 40:
            msg += f" (got {shown})"
    if err["type"] == "extra_forbidden":
        msg = "unknown field (check its spelling against docs/contracts.md)"
    if where and msg.startswith(f"{where.split('.')[-1]}:"):
        # A model-level check that already names its field: don't say the field twice.
        where = ".".join(where.split(".")[:-1])
    return f"{where}: {msg}" if where else msg


def validate(model: type[M], data: Any, source: str) -> M:
    if data is None:
        raise InputError(f"{source}: empty document")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise InputError(f"{source}: {_describe(exc)}") from None


def load_topology(path: str | Path) -> Topology:
    p = Path(path)
    return validate(Topology, _read(p), str(p))


def load_job(path: str | Path) -> JobSpec:
    p = Path(path)
    return validate(JobSpec, _read(p), str(p))


def load_reservations(path: str | Path, topology: Topology | None = None) -> Reservations:
    """Read held GPUs / reserved WAN bandwidth; with a topology, check they refer to it."""
    p = Path(path)
    res = validate(Reservations, _read(p), str(p))
    if topology is not None:
        check_reservations(res, topology, str(p))
    return res


def check_reservations(res: Reservations, topology: Topology, source: str) -> None:
    nodes = {(n.site, n.name): n.spec.gpu.count for n in topology.nodes()}
    for site, per_node in res.gpus.items():
        for node, gpus in per_node.items():
            if (site, node) not in nodes:
                raise InputError(f"{source}: gpus.{site}.{node}: no such node in the topology")
            bad = [g for g in gpus if not 0 <= g < nodes[(site, node)]]
            if bad:
                raise InputError(
                    f"{source}: gpus.{site}.{node}: GPU index {bad[0]} out of range "
                    f"0..{nodes[(site, node)] - 1}"
                )
    links = {link.key for link in topology.links}
    for key, gbps in res.wan_gbps.items():
        a, _, b = key.partition("|")
        if link_key(a, b) not in links:
            raise InputError(f"{source}: wan_gbps.{key}: no such link in the topology")
        if gbps < 0:
            raise InputError(f"{source}: wan_gbps.{key}: must be ≥ 0, got {gbps}")


def dump_yaml(model: BaseModel) -> str:
    return yaml.safe_dump(model.model_dump(mode="json", exclude_none=True), sort_keys=False)

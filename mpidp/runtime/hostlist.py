"""Host lists as launchers take them: ``host:slots,host:slots`` (Hydra's ``-hosts``,
horovodrun's ``-H``) and host files (``host slots=N`` as Open MPI and Horovod write them,
``host:N`` as Hydra does, or a bare ``host``: one slot). Neither torch nor MPI is imported."""
from __future__ import annotations

from typing import NamedTuple, Sequence


class Host(NamedTuple):
    name: str
    slots: int


def parse(hosts: str, flag: str = "-H") -> list:
    """[Host] from ``host:slots,host,...`` (a missing count is one slot); ValueError naming
    ``flag`` and the bad item."""
    out = []
    for item in hosts.split(","):
        name, colon, slots = item.strip().partition(":")
        if not name or (colon and (not slots.isdigit() or int(slots) < 1)):
            raise ValueError(f"{flag} {hosts}: expected host:slots,host:slots,... (got {item!r})")
        out.append(Host(name, int(slots) if colon else 1))
    return out


def of_file(text: str, path: str = "hostfile") -> list:
    """[Host] from a host file's ``text``: one host per line, ``host slots=N``, ``host:N`` or
    ``host``; ``#`` starts a comment. ValueError naming the file and line."""
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        first, *rest = line.split()
        name, colon, count = first.partition(":")
        ok = bool(name) and (not colon or (count.isdigit() and int(count) >= 1)) \
            and not (colon and rest)
        slots = int(count) if colon and ok else 1
        for word in rest:
            key, _, value = word.partition("=")
            if key != "slots" or not value.isdigit() or int(value) < 1:
                ok = False
            else:
                slots = int(value)
        if not ok:
            raise ValueError(f"{path}:{number}: expected 'host slots=N' or 'host:N', "
                             f"got {line!r}")
        out.append(Host(name, slots))
    if not out:
        raise ValueError(f"{path}: no hosts in it")
    return out


def read_file(path: str, what: str) -> list:
    """[Host] from the host file at ``path`` (``of_file``); ValueError in one line naming
    ``what`` ("--hostfile F", "HYDRA_HOST_FILE=F") where it cannot be read or is not UTF-8
    text."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ValueError(f"{what}: cannot read the host file: {exc.strerror}") from None
    try:
        text = data.decode()
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ValueError(f"{what}: line {line} is not UTF-8 text (byte {data[exc.start]:#04x}"
                         f"): a host file holds host names") from None
    return of_file(text, what)


def format_hosts(hosts: Sequence[Host]) -> str:
    """Hydra's ``-hosts`` argument for ``hosts``."""
    return ",".join(f"{h.name}:{h.slots}" for h in hosts)

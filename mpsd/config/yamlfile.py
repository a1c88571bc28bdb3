"""The config file read as untrusted input: one bounded open and read, one bounded YAML parse.

Whatever the path is (a FIFO, a directory, a device, a file that is too large or not UTF-8)
and whatever the YAML holds (tags whose constructors raise, integers of thousands of digits,
nesting deep enough to exhaust Python's stack, alias bombs), :func:`load` returns the
document or raises a ConfigError with one line naming the file and, where known, the line.

Bounds: MAX_FILE_BYTES of UTF-8 text; values nested at most MAX_DEPTH levels and at most
MAX_NODES values once aliases are expanded (a "billion laughs" file is a few hundred bytes:
its aliases share one object, which every consumer that walks or prints it then expands);
integers below 2**64 (no setting takes more; Python refuses int() of more than 4300 digits).
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Any, Iterator

import yaml
from yaml.composer import ComposerError
from yaml.constructor import ConstructorError, SafeConstructor

from ..errors import ConfigError, one_line
from ..units import shown

MAX_FILE_BYTES = 64 * 1024  # a full config with comments is a few KiB
MAX_DEPTH = 32  # a config nests 3 levels
MAX_NODES = 10_000  # values after alias expansion; a config has about 50
MAX_INT = (1 << 64) - 1
_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


def load(path: str) -> Any:
    """The YAML document in ``path`` (None when empty); ConfigError with one line otherwise."""
    name = display(path)
    data = _read(path, name)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConfigError(
            f"{name}: not UTF-8 text at line {line} (byte 0x{data[exc.start]:02x}); save the file as UTF-8"
        ) from None
    try:
        return _parse(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = _cut(one_line(exc.problem or exc.context or "malformed"))
        raise ConfigError(f"{name}: not valid YAML{where}: {problem}") from None
    except yaml.reader.ReaderError as exc:  # a character YAML does not allow
        line = text.count("\n", 0, exc.position) + 1
        raise ConfigError(
            f"{name}: not valid YAML at line {line}: character U+{exc.character:04X} not allowed"
        ) from None
    except (yaml.YAMLError, RecursionError) as exc:  # neither should happen within the bounds above
        raise ConfigError(f"{name}: not valid YAML: {type(exc).__name__}: {_cut(one_line(exc))}") from None


def _cut(problem: str, limit: int = 200) -> str:
    """PyYAML quotes the offending text (a tag, a token): one of thousands of characters too."""
    return problem if len(problem) <= limit else f"{problem[:limit]}... ({len(problem)} characters)"


def display(path: str) -> str:
    """The path as error messages name it: quoted when it holds a line break or the like."""
    return path if path.isprintable() else repr(path)


def _read(path: str, name: str) -> bytes:
    """At most MAX_FILE_BYTES + 1 bytes of a regular file. O_NONBLOCK: opening a FIFO waits
    for a writer otherwise (it is refused right after, as anything but a regular file is)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"{name}: cannot read config file: {exc.strerror}") from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise ConfigError(f"{name}: cannot read config file: {os.strerror(errno.EISDIR)}; expected a YAML file")
        if not stat.S_ISREG(mode):
            kind = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
            raise ConfigError(f"{name}: cannot read config file: not a regular file ({kind}); expected a YAML file")
        chunks, size = [], 0
        while size <= MAX_FILE_BYTES:
            chunk = os.read(fd, MAX_FILE_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise ConfigError(f"{name}: cannot read config file: {exc.strerror}") from None
    finally:
        os.close(fd)
    if size > MAX_FILE_BYTES:
        raise ConfigError(f"{name}: cannot read config file: larger than the {MAX_FILE_BYTES} bytes accepted")
    return b"".join(chunks)


class _Loader(yaml.SafeLoader):
    """SafeLoader with the bounds of this module. The composer recurses once per level of
    nesting: counted here, so that Python's own recursion limit is never reached."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):
        if self._depth >= MAX_DEPTH:
            raise ComposerError(
                None, None, f"values nested deeper than {MAX_DEPTH} levels", self.peek_event().start_mark
            )
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_object(self, node, deep=False):
        # A scalar's constructor is Python's int(), float(), date()...: !!float x raises
        # ValueError, !!timestamp soon an AttributeError. Each becomes an error at its line.
        try:
            return super().construct_object(node, deep)
        except yaml.YAMLError:
            raise
        except Exception as exc:  # noqa: BLE001 - a scalar's constructor may raise anything
            tag = node.tag.replace("tag:yaml.org,2002:", "!!")
            value = f" {shown(node.value)}" if isinstance(node, yaml.ScalarNode) else ""
            raise ConstructorError(
                None, None, f"cannot read {tag} value{value} ({type(exc).__name__})", node.start_mark
            ) from None


def _construct_int(loader: _Loader, node: yaml.ScalarNode) -> int:
    text = loader.construct_scalar(node)
    if len(text) > 100:  # before int(): more than 4300 digits raise, and 2**64 needs fewer than 100
        raise ConstructorError(
            None, None, f"an integer of {len(text)} characters; none above 2**64-1 is accepted", node.start_mark
        )
    value = SafeConstructor.construct_yaml_int(loader, node)
    if abs(value) > MAX_INT:
        raise ConstructorError(None, None, "an integer above 2**64-1; none so large is accepted", node.start_mark)
    return value


_Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)


def _parse(text: str) -> Any:
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _measure(node, 1, {}, set())
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _children(node: yaml.Node) -> Iterator[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        yield from node.value
    elif isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            yield key
            yield value


def _measure(node: yaml.Node, depth: int, seen: dict[int, tuple[int, int]], open_: set[int]) -> tuple[int, int]:
    """(values, levels) under ``node`` with aliases expanded; raises past the bounds. An
    alias is the same node object met again: measured once, so the walk stays linear."""
    if id(node) in seen:
        count, height = seen[id(node)]
    elif id(node) in open_:
        raise ComposerError(None, None, "an alias refers to a value that contains it", node.start_mark)
    else:
        open_.add(id(node))
        count, height = 1, 1
        for child in _children(node):
            if depth >= MAX_DEPTH:
                raise ComposerError(
                    None, None, f"values nested deeper than {MAX_DEPTH} levels (aliases expanded)", child.start_mark
                )
            n, h = _measure(child, depth + 1, seen, open_)
            count, height = count + n, max(height, h + 1)
            if count > MAX_NODES:
                raise ComposerError(
                    None, None, f"more than {MAX_NODES} values once aliases are expanded", child.start_mark
                )
        open_.discard(id(node))
        seen[id(node)] = (count, height)
    if depth + height - 1 > MAX_DEPTH:
        raise ComposerError(
            None, None, f"values nested deeper than {MAX_DEPTH} levels (aliases expanded)", node.start_mark
        )
    return count, height

"""One exception tree for the whole package. Boundaries translate OS and library errors
into these with ``raise ... from``; only the CLI turns them into exit codes."""


class MpsdError(Exception):
    """Base class: the message is one line naming the offending value and what is accepted."""


class ConfigError(MpsdError, ValueError):
    """A malformed config file, flag or limit string."""


class ControlError(MpsdError):
    """The MPS control daemon rejected a command, timed out or could not be reached."""


class ControlTimeout(ControlError):
    """A control command got no answer in time (the daemon may be hung)."""


class ControlBusy(ControlError):
    """The daemon refused the connection: it serves one front-end at a time, and another one
    (``mpsd status``, an operator's interactive session) held it for the whole timeout. The
    daemon is alive: it answered with a refusal."""


class ControlImpostor(ControlError):
    """A control socket in the pipe dir is served by another process than the daemon mpsd
    started (something renamed its own socket over it): nothing it answers is acted on."""


class DaemonNotRunning(ControlError):
    """No control daemon answers on the pipe directory."""


class SetupError(MpsdError):
    """A directory, binary or permission the daemon needs is missing or wrong."""


class InventoryError(MpsdError):
    """NVML could not be loaded or queried."""


class PluginError(MpsdError):
    """The kubelet device plugin could not register, serve or allocate."""


class DraError(MpsdError):
    """The DRA kubelet plugin could not register, or prepare or unprepare a ResourceClaim."""


class DependencyError(MpsdError):
    """A Python package mpsd needs is missing or too old for it (e.g. grpcio below what the
    generated gRPC code was generated with)."""


def one_line(text: object) -> str:
    """``text`` with every run of whitespace, line breaks included (those str.splitlines()
    knows: \\n, \\r, \\v, \\f, \\x1c-\\x1e, \\x85, U+2028, U+2029), made one space, and
    what is left that a terminal would act on escaped (:func:`printable`)."""
    return printable(" ".join(str(text).split()))


_NAMED = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}


def printable(text: object) -> str:
    """``text`` safe to print on a terminal: every character that is not printable (C0
    controls, DEL, C1 controls such as CSI, and so ESC and every escape sequence it would
    start; format characters such as bidi overrides; line and paragraph separators; lone
    surrogates) written as its Python escape (``\\x1b``, ``\\u202e``); the rest unchanged.
    Everything mpsd prints that others chose (a client's argv, file names) goes through it."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else _NAMED.get(ch) or _escape(ord(ch)) for ch in text)


def _escape(code: int) -> str:
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


class KubeAPIError(MpsdError):
    """The Kubernetes API server could not be configured, reached or answered with an error.
    ``status`` is the HTTP status code of an answer (404, 409 ...), None when there was none."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class BackendError(MpsdError):
    """The node's sharing backend (mpsd/sharing) cannot give a slice: a namespace the MPS v3
    daemon refused, a memory limit the driver refused or the backend cannot enforce."""

"""What a PromQL expression refers to: its metric names with their label matchers, and the
labels it groups or matches on. Enough of PromQL for dashboards (selectors, functions,
aggregations with by/without, binary operators with on/ignoring/group_left/group_right, range
and subquery brackets); anything else it does not know is an error, never silently skipped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

TOKEN = re.compile(
    r"""(?P<ws>\s+)
      |(?P<str>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
      |(?P<range>\[[^\]]*\])
      |(?P<num>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
      |(?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
      |(?P<op>=~|!~|!=|==|>=|<=|[{}(),=<>+\-*/^%])""",
    re.VERBOSE,
)
FUNCTIONS = {
    "sum", "avg", "min", "max", "count", "topk", "bottomk", "quantile", "stddev", "group",
    "rate", "irate", "increase", "delta", "idelta", "deriv", "changes", "resets",
    "avg_over_time", "max_over_time", "min_over_time", "sum_over_time", "last_over_time",
    "histogram_quantile", "clamp_min", "clamp_max", "abs", "time", "timestamp", "vector",
    "absent", "round", "ceil", "floor", "scalar",
}  # fmt: skip
GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
OPERATOR_WORDS = {"and", "or", "unless", "bool"}


class PromQLError(ValueError):
    """The expression uses something this reader does not know."""


@dataclass
class Refs:
    selectors: list[tuple[str, list[str]]] = field(default_factory=list)  # (metric, matcher labels)
    grouping: list[str] = field(default_factory=list)  # labels of by/without/on/ignoring/group_*

    @property
    def metrics(self) -> set[str]:
        return {name for name, _ in self.selectors}


def tokens(expr: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(expr):
        m = TOKEN.match(expr, pos)
        if not m:
            raise PromQLError(f"unexpected {expr[pos : pos + 10]!r} at {pos} in {expr!r}")
        if m.lastgroup != "ws":
            out.append((m.lastgroup, m.group()))
        pos = m.end()
    return out


def _matchers(toks: list[tuple[str, str]], i: int, expr: str) -> tuple[list[str], int]:
    """Labels of the matchers from toks[i] == '{' to its '}'; returns them and the index after."""
    labels, i = [], i + 1
    while toks[i][1] != "}":
        if toks[i][0] != "ident" or toks[i + 1][1] not in ("=", "!=", "=~", "!~") or toks[i + 2][0] != "str":
            raise PromQLError(f"bad label matcher near {toks[i][1]!r} in {expr!r}")
        labels.append(toks[i][1])
        i += 3
        if toks[i][1] == ",":
            i += 1
    return labels, i + 1


def _label_list(toks: list[tuple[str, str]], i: int, expr: str) -> tuple[list[str], int]:
    """Labels of a '(' a, b ')' list starting at toks[i] == '('."""
    labels, i = [], i + 1
    while toks[i][1] != ")":
        if toks[i][0] != "ident":
            raise PromQLError(f"bad label list near {toks[i][1]!r} in {expr!r}")
        labels.append(toks[i][1])
        i += 2 if toks[i + 1][1] == "," else 1
    return labels, i + 1


def refs(expr: str) -> Refs:
    toks = tokens(expr) + [("end", "")]
    found = Refs()
    i = 0
    while toks[i][0] != "end":
        kind, text = toks[i]
        nxt = toks[i + 1][1]
        if kind == "ident" and text in GROUPING:
            if nxt == "(":
                labels, i = _label_list(toks, i + 1, expr)
                found.grouping.extend(labels)
            else:
                i += 1  # group_left without a label list
        elif kind == "ident" and (nxt == "(" or (text in FUNCTIONS and nxt in GROUPING)):
            if text not in FUNCTIONS:
                raise PromQLError(f"unknown function {text!r} in {expr!r}")
            i += 1
        elif kind == "ident" and text in OPERATOR_WORDS:
            i += 1
        elif kind == "ident" and text == "offset":
            raise PromQLError(f"offset is not supported here: {expr!r}")
        elif kind == "ident":
            labels: list[str] = []
            i += 1
            if nxt == "{":
                labels, i = _matchers(toks, i, expr)
            found.selectors.append((text, labels))
        elif text == "{":
            raise PromQLError(f"a selector without a metric name in {expr!r}")
        else:
            i += 1
    return found


LABEL_VALUES = re.compile(r"label_values\(\s*(?P<query>.*?)\s*,\s*(?P<label>[A-Za-z_]\w*)\s*\)\s*$")


def template_refs(query: str) -> tuple[Refs, str]:
    """Grafana's ``label_values(<selector>, label)``: the selector's refs and the label."""
    m = LABEL_VALUES.match(query.strip())
    if not m:
        raise PromQLError(f"only label_values(<selector>, <label>) is supported, got {query!r}")
    return refs(m.group("query")), m.group("label")


LEGEND_LABEL = re.compile(r"\{\{\s*([A-Za-z_]\w*)\s*\}\}")


def legend_labels(legend: str) -> list[str]:
    return LEGEND_LABEL.findall(legend or "")

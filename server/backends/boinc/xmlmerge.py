"""Merge boinc-dl's entries into a project's XML files, preserving everything else.

``config.xml``, ``project.xml`` and ``plan_class_spec.xml`` belong to the project: we
parse them with a real XML parser (comments and processing instructions kept, the
whitespace of untouched elements kept as it was), change only our own entries,
indent new ones like their siblings, and write the file only if something changed.
"""

from __future__ import annotations

import os
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from boinc_dl.server.backends.boinc.project import BoincProjectError

_DECL = re.compile(r"^\s*<\?xml[^>]*\?>\s*")
_EMPTY = re.compile(r"<([A-Za-z_][^<>!?]*?) />")


def to_xml(el: ET.Element) -> str:
    """Serialize with empty elements as ``<tag/>``: BOINC's PHP reads flags in
    config.xml with a literal search for ``<tag/>`` (``parse_bool`` in util_basic.inc)."""
    return _EMPTY.sub(r"<\1/>", ET.tostring(el, encoding="unicode"))


@dataclass
class XmlDoc:
    """A parsed XML file and what was changed in it."""

    path: Path
    root: ET.Element
    declaration: str = ""
    changes: list[str] = field(default_factory=list)

    @classmethod
    def load(cls, path: Path, root_tag: str, create: bool = False) -> XmlDoc:
        if not path.exists():
            if not create:
                raise BoincProjectError(f"{path} is missing")
            doc = cls(path, ET.Element(root_tag))
            doc.root.text = "\n"
            doc.changes.append(f"created {path.name}")
            return doc
        text = path.read_text()
        # Not host data: the project's own templates and config (admin-written);
        # expat neither fetches external entities nor expands entity bombs (>= 2.4.1).
        parser = ET.XMLParser(target=ET.TreeBuilder(insert_comments=True, insert_pis=True))  # nosec B314
        try:
            root = ET.fromstring(text, parser=parser)  # nosec B314
        except ET.ParseError as e:
            raise BoincProjectError(f"{path}: not well-formed XML ({e}); fix it by hand first") from None
        if root.tag != root_tag:
            raise BoincProjectError(f"{path}: root element is <{root.tag}>, expected <{root_tag}>")
        m = _DECL.match(text)
        return cls(path, root, m.group(0) if m else "")

    def save(self) -> bool:
        """Write the file if anything changed (atomically); True if written."""
        if not self.changes:
            return False
        body = to_xml(self.root)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(self.declaration + body + "\n")
        if self.path.exists():
            os.chmod(tmp, self.path.stat().st_mode & 0o7777)
        os.replace(tmp, self.path)
        return True


def child_text(el: ET.Element, tag: str) -> str:
    c = el.find(tag)
    return (c.text or "").strip() if c is not None else ""


def _indent_of(parent: ET.Element, depth: int, unit: str) -> str:
    """Whitespace before a child of ``parent`` (taken from an existing child)."""
    if len(parent) and parent.text and parent.text.strip() == "" and "\n" in parent.text:
        return parent.text
    return "\n" + unit * (depth + 1)


def append_child(parent: ET.Element, child: ET.Element, depth: int, unit: str = "    ") -> None:
    """Append ``child`` (at nesting ``depth`` of ``parent``) indented like its siblings."""
    lead = _indent_of(parent, depth, unit)
    inner_unit = _unit_from(lead, depth + 1) or unit
    ET.indent(child, space=inner_unit, level=depth + 1)
    if len(parent):
        last = parent[-1]
        child.tail = last.tail if last.tail is not None else "\n" + unit * depth
        last.tail = lead
    else:
        parent.text = lead
        child.tail = "\n" + unit * depth
    parent.append(child)


def replace_child(parent: ET.Element, old: ET.Element, new: ET.Element, depth: int, unit: str = "    ") -> None:
    """Put ``new`` where ``old`` was, keeping ``old``'s surrounding whitespace."""
    idx = list(parent).index(old)
    lead = _indent_of(parent, depth, unit)
    ET.indent(new, space=_unit_from(lead, depth + 1) or unit, level=depth + 1)
    new.tail = old.tail
    parent.remove(old)
    parent.insert(idx, new)


def remove_child(parent: ET.Element, old: ET.Element) -> None:
    """Remove ``old``; the previous sibling (or parent text) takes over its tail."""
    idx = list(parent).index(old)
    if idx == len(parent) - 1:
        if idx > 0:
            parent[idx - 1].tail = old.tail
        else:
            parent.text = old.tail
    parent.remove(old)


def _unit_from(lead: str, depth: int) -> str:
    ws = lead.rsplit("\n", 1)[-1]
    if depth <= 0 or not ws or len(ws) % depth:
        return ""
    return ws[: len(ws) // depth]


def same_element(a: ET.Element, b: ET.Element) -> bool:
    """Equal tags, attributes, stripped texts and children (whitespace ignored)."""
    if a.tag != b.tag or a.attrib != b.attrib or (a.text or "").strip() != (b.text or "").strip():
        return False
    ca = [c for c in a if isinstance(c.tag, str)]
    cb = [c for c in b if isinstance(c.tag, str)]
    return len(ca) == len(cb) and all(same_element(x, y) for x, y in zip(ca, cb, strict=True))


def simple(tag: str, children: list[tuple[str, str | None]]) -> ET.Element:
    """``<tag><k>v</k>...</tag>`` (``v`` None gives an empty element ``<k/>``)."""
    el = ET.Element(tag)
    for k, v in children:
        c = ET.SubElement(el, k)
        if v is not None:
            c.text = v
    return el


def upsert_named(doc: XmlDoc, tag: str, want: ET.Element) -> str | None:
    """Make ``doc``'s top-level ``<tag>`` whose ``<name>`` is ``want``'s equal to ``want``
    (the first such one is replaced; none: ``want`` is appended). Returns "added",
    "updated" or None when it was already so; a change is recorded in ``doc.changes``."""
    name = child_text(want, "name")
    cur = [el for el in doc.root.findall(tag) if child_text(el, "name") == name]
    if cur and same_element(cur[0], want):
        return None
    if cur:
        replace_child(doc.root, cur[0], want, 0)
    else:
        append_child(doc.root, want, 0)
    doc.changes.append(name)
    return "updated" if cur else "added"

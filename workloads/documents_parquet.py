"""Parquet documents: the text column of a Parquet source file, for `iter_documents` in
workloads/documents.py.

pyarrow is imported inside the functions, so only Parquet sources pay for its import.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, BinaryIO

from workloads.documents_text import utf8
from workloads.sources import DatasetError, SourceFile

if TYPE_CHECKING:
    from workloads.documents import ReadOptions


def parquet_documents(fh: BinaryIO, src: SourceFile, cfg: ReadOptions) -> Iterator[bytes]:
    """The value of column `text_field` in each row of the Parquet file `fh`, in order."""
    import pyarrow as pa  # only Parquet sources pay for the import
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    field = cfg.text_field
    try:
        pf = pq.ParquetFile(fh)
    except (pa.ArrowException, OSError) as exc:
        if _failed_to_read(exc):
            raise  # iter_documents says so
        raise DatasetError(f"{src.uri}: not a readable Parquet file: {exc}") from None
    schema = pf.schema_arrow
    path = _column_path(schema, field, src.uri)
    if path is None:
        columns = ", ".join(schema.names[:10])
        raise DatasetError(f"{src.uri}: no column {field!r} (columns: {columns}); set text_field")
    kind = path[-1].type
    if pa.types.is_dictionary(kind):  # e.g. a low-cardinality column written by pandas
        kind = kind.value_type
    t = pa.types
    is_text = t.is_string(kind) or t.is_large_string(kind) or t.is_string_view(kind)
    is_binary = t.is_binary(kind) or t.is_large_binary(kind) or t.is_binary_view(kind)
    if not (is_text or is_binary):
        raise DatasetError(f"{src.uri}: column {field!r} has type {kind}, not text")
    # The column is read by its index among the file's leaf columns, not by name: pyarrow
    # takes a name as a dotted path prefix, so "meta.text" would also select the child of
    # a struct `meta` (and read it first), and a name given twice has no single column.
    # `column_paths` splits each leaf's path into its names, so a dot inside one is kept.
    names = [f.name for f in path]
    leaves = [i for i, p in enumerate(pf.reader.column_paths) if p == names]
    if len(leaves) != 1:  # not expected once the names are unique, but never a KeyError
        raise DatasetError(f"{src.uri}: column {field!r} is not one Parquet column")
    leaf = leaves[0]
    row = 1
    for group in range(pf.num_row_groups):
        try:
            column = pf.reader.read_row_group(group, column_indices=[leaf]).column(0)
            for child in path[1:]:  # a nested column is read as its parents' structs
                column = pc.struct_field(column, child.name)
        except (pa.ArrowException, OSError) as exc:
            if _failed_to_read(exc):
                raise
            raise DatasetError(
                f"{src.uri}: cannot read column {field!r} of row group {group}: {exc}"
            ) from None
        # Pyarrow reads a string column without checking its UTF-8: one vectorised check
        # per row group, and only a group that fails is checked value by value.
        checked = is_text and _valid_utf8(column)
        for value in column.cast(pa.large_binary()).to_pylist():
            if value is None:
                raise DatasetError(f"{src.uri}: row {row}: column {field!r} is null")
            if not checked:
                place = f"{src.uri}: row {row}: column {field!r}"
                value = utf8(value, place, 0, cfg.errors, "of the value")
            yield value
            row += 1


def _failed_to_read(exc: Exception) -> bool:
    """Whether pyarrow passed on an error of the file's reads, not of its content: the
    object changed (`FileNotFoundError`) or the store refused it (a 403), which carry an
    errno as a disk's read error does; pyarrow's own errors about the format have none.
    Such a file may be a perfectly good Parquet file."""
    return isinstance(exc, FileNotFoundError) or getattr(exc, "errno", None) is not None


def _column_path(schema: object, field: str, uri: str) -> list | None:
    """The fields from the top-level column down to `field`: one for a column of that name
    (taken first), more for a dotted path into struct columns (`meta.text`); None if there
    is none.

    Raises:
        DatasetError: naming the file and the column, if a name on the way is given twice
            (a file may hold two columns of one name; which is the text is unknowable).
    """
    import pyarrow as pa

    parts = [field] if field in schema.names else field.split(".")
    path: list = []
    parent = schema  # then each struct type on the way down; None below a leaf
    for part in parts:
        found = parent.get_all_field_indices(part) if parent is not None else []
        if not found:
            return None
        if len(found) > 1:
            name = ".".join([*(f.name for f in path), part])
            raise DatasetError(
                f"{uri}: column {name!r} appears {len(found)} times; the text column must "
                "have a name of its own"
            )
        path.append(parent.field(found[0]))
        parent = path[-1].type if pa.types.is_struct(path[-1].type) else None
    return path


def _valid_utf8(column: object) -> bool:
    import pyarrow as pa

    try:
        column.cast(pa.large_string()).validate(full=True)  # also decodes a dictionary
    except pa.ArrowInvalid:
        return False
    return True

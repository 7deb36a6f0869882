"""The names of verification's checks, as manifests, reports, the CLI and the UI show them."""

from enum import StrEnum


class VerifyCheck(StrEnum):
    COMPLETE = "complete"  # the save finished: its markers and files are all there
    METADATA_JSON = "metadata.json"
    DCP_METADATA = "dcp-metadata"
    FILES = "files"
    RECORDS = "records"
    COVERAGE = "coverage"
    OBJECTS = "objects"
    CRC = "crc"
    INTEGRITY_JSON = "integrity.json"
    MANIFEST = "manifest"
    STATE = "state"
    ITERATION = "iteration"
    LAYOUT = "layout"
    VALUES = "values"
    OPTIMIZER = "optimizer"
    LINEAGE = "lineage"

"""Stand-in for pydcgm: a handle whose system reports the GPUs of the recorded run."""

from types import SimpleNamespace

import DcgmDiag


class DcgmHandle:
    def __init__(self, opMode=None, ipAddress=None):
        self.handle = object()

    def GetSystem(self):
        gpus = sorted({r.entity.entityId for r in DcgmDiag.RECORDED.results[: DcgmDiag.RECORDED.numResults]})
        return SimpleNamespace(discovery=SimpleNamespace(GetAllSupportedGpuIds=lambda: gpus))

"""Will a run fit a TPU slice, and how fast at best: the run without weights and its programs lowered for a
topology (`abstract_run`), compiling and the fit search (`fit`), FLOPs and bytes from compiled HLO (`hlo_cost`),
collectives and copies inside loops (`hlo_inspect`), the weights a decode step reads (`decode_reads`), and
the chip table and roofline (`roofline`).
"""

from jgrpo._moved import moved_attribute

_OLD_NAMES = {name: "jgrpo.planning.fit"
              for name in ("GIB", "Candidate", "ProgramReport", "compile_program", "fit", "plan_iteration",
                           "refused_bytes")}


def __getattr__(name: str):  # `from jgrpo.planning import plan_iteration`: the module before the rooms, one release
    return moved_attribute(__name__, name, _OLD_NAMES)

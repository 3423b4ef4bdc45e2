"""``hvd.elastic`` of ``horovod.tensorflow``: ``run``, ``TensorFlowKerasState`` and
``TensorFlowState`` on MPI's ULFM.

The loop (sync from rank 0, run, and on a lost rank: restore the last commit, shrink the
communicator, reset callbacks, sync again) is :func:`mpilearn.torch.elastic.run`, shared with
the torch and Keras sides; the states are :mod:`mpilearn.keras.elastic`'s, broadcast by this
module's ``broadcast_variables``. A lost rank inside a ``tf.function`` reaches Python as
TensorFlow's ``UnknownError`` carrying MPI's text, which that loop recognises. TensorFlow 1
sessions are not supported (eager only).
"""
from __future__ import annotations

from ..keras.elastic import KerasState, VariablesState
from ..torch.elastic import HorovodInternalError, HostsUpdatedInterrupt, ObjectState, State, run
from .gradients import broadcast_variables


class TensorFlowKerasState(KerasState):
    """A built Keras model, its optimizer and plain values (``epoch=0, batch=0, ...``)."""

    def broadcast(self, variables) -> None:
        broadcast_variables(variables, root_rank=0)


class TensorFlowState(VariablesState):
    """A list of ``tf.Variable``s and plain values as one state (eager TensorFlow 2)."""

    def __init__(self, variables=None, session=None, **kwargs):
        if variables is None:
            raise ValueError("TensorFlowState needs its variables: TensorFlow 2 has no global "
                             "variable collection (pass variables=model.variables)")
        if session is not None:
            raise ValueError("TensorFlowState: TensorFlow 1 sessions are not supported")
        object.__setattr__(self, "variables", list(variables))
        super().__init__(**kwargs)
        self.save()

    def variables_to_keep(self) -> list:
        return self.variables

    def broadcast(self, variables) -> None:
        broadcast_variables(variables, root_rank=0)


__all__ = ["run", "State", "ObjectState", "TensorFlowKerasState", "TensorFlowState",
           "HorovodInternalError", "HostsUpdatedInterrupt"]

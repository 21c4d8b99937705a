"""What the Python mirrors of the native hook states share: checkpointing through ``self._cpp``."""
import logging
from typing import Any, Dict

logger = logging.getLogger("ddpx")


class NativeStateCheckpoint:
    """``state_dict()`` / ``load_state_dict()`` and pickling for a class whose native state is
    ``self._cpp``; subclasses define ``__setstate__`` (how to rebuild the native state)."""

    _cpp: Any

    def state_dict(self) -> Dict[str, Any]:
        """Everything needed to resume, without the process groups (not serialisable)."""
        return self._cpp.state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restores :meth:`state_dict`'s content."""
        self._cpp.load_state_dict(state_dict)

    def __getstate__(self) -> Dict[str, Any]:
        logger.warning("NOTE: Process group is not serializable and excluded from a saved state.")
        return self.state_dict()

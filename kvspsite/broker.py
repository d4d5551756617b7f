"""The embedded default's broker: kombu's filesystem transport, with messages written whole.

kombu writes a message straight into the queue folder under its final name, and a reader that
polls the folder may move and read the file before the writer has written it: the reading
worker then dies on an empty message (``JSONDecodeError``). Here a message is written under a
name no queue matches and renamed into place, which POSIX makes atomic, so a reader sees a
whole message or none."""

from __future__ import annotations

import os
import uuid
from time import monotonic

from kombu.transport import filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps


class Channel(filesystem.Channel):
    def _put(self, queue, payload, **kwargs):
        name = f"{round(monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        partial = os.path.join(self.data_folder_out, f".{uuid.uuid4()}.partial")
        try:
            with open(partial, "wb") as file:
                file.write(str_to_bytes(dumps(payload)))
            os.replace(partial, final)
        except OSError as exc:
            raise filesystem.ChannelError(f"Cannot add file {final!r} to directory") from exc


class Transport(filesystem.Transport):
    Channel = Channel

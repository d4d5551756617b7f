"""The embedded default's broker delivers every message whole while writers and a reader work
on the queue folder at once (kombu's own filesystem transport can hand a reader a message its
writer has not written yet, and the reading worker dies)."""

import threading

from kombu import Connection

from kvspsite.broker import Transport

MESSAGES = 400


def test_messages_written_while_read_arrive_whole(tmp_path):
    folders = {
        "data_folder_in": str(tmp_path),
        "data_folder_out": str(tmp_path),
        # kombu writes the queue's bindings there ("control" in the working directory otherwise)
        "control_folder": str(tmp_path / "control"),
        "polling_interval": 0,
    }
    sent = [{"n": n, "body": "x" * 2048} for n in range(MESSAGES)]

    def write(part):
        with Connection(transport=Transport, transport_options=folders) as connection:
            queue = connection.SimpleQueue("q")
            for message in part:
                queue.put(message)

    writers = [threading.Thread(target=write, args=(sent[i::4],)) for i in range(4)]
    received = []
    with Connection(transport=Transport, transport_options=folders) as connection:
        queue = connection.SimpleQueue("q")
        for writer in writers:
            writer.start()
        while len(received) < MESSAGES:
            message = queue.get(timeout=30)
            received.append(message.payload)
            message.ack()
    for writer in writers:
        writer.join()
    assert sorted(m["n"] for m in received) == list(range(MESSAGES))
    assert all(m["body"] == "x" * 2048 for m in received)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]

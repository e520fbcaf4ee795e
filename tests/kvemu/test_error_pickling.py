"""Errors cross process boundaries (sweeps, worker processes) by pickle, attributes and all."""

import pickle

from kvemu.wire.codec import WireDecodeError
from workers.admission import RejectReason, RequestRejected


def test_errors_with_their_own_init_arguments_pickle_too():
    """A subclass whose __init__ takes more than the message (a worker's refusal, a bad wire payload)
    still round-trips: unpickling does not call __init__ again."""
    for err in (RequestRejected(RejectReason.MALFORMED, "tokens: not u32", field="tokens"),
                WireDecodeError("truncated", b"\x92\x01", endpoint="tcp://w1", seq=4)):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and str(back) == str(err) and back.__dict__ == err.__dict__

"""Job-end callbacks: a signed POST to a job's ``callback_url`` once it ends (see ``notifier``)."""

from dagfold.services.callbacks.egress import EgressRules, RefusedDestination
from dagfold.services.callbacks.exceptions import CallbackConfigError, CallbackError
from dagfold.services.callbacks.ledger import DELIVERED, FAILURES, GAVE_UP, PENDING, CallbackLedger
from dagfold.services.callbacks.notifier import LEDGER_DIR, CallbackNotifier, Outcome, classify
from dagfold.services.callbacks.options import CallbackOptions
from dagfold.services.callbacks.signing import DELIVERY_HEADER, SIGNATURE_HEADER, TIMESTAMP_HEADER, sign, verify

__all__ = [
    "DELIVERED",
    "DELIVERY_HEADER",
    "FAILURES",
    "GAVE_UP",
    "LEDGER_DIR",
    "PENDING",
    "SIGNATURE_HEADER",
    "TIMESTAMP_HEADER",
    "CallbackConfigError",
    "CallbackError",
    "CallbackLedger",
    "CallbackNotifier",
    "CallbackOptions",
    "EgressRules",
    "Outcome",
    "RefusedDestination",
    "classify",
    "sign",
    "verify",
]

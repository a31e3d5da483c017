package natsinbox

import (
	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/inbox"
)

// Source is what the ledger records as the source of the events this
// front runs.
const Source inbox.Source = "nats"

// DefaultID is the front's event ID extractor: the Nats-Msg-Id header
// (JetStream's own dedupe ID), then consumer.DefaultID's headers.
var DefaultID = consumer.FirstID(consumer.HeaderID("Nats-Msg-Id"), consumer.DefaultID)

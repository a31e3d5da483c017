package tracing

import (
	"strings"

	"github.com/justonce/justonce/consumer"
)

// HeaderCarrier adapts message headers to propagation.TextMapCarrier, so
// that a propagator reads and writes trace context in a consumer.Message's
// Headers (and in the headers of messages you publish):
//
//	c := tracing.HeaderCarrier(m.Headers)
//	ctx = otel.GetTextMapPropagator().Extract(ctx, &c)
//
//	c := tracing.HeaderCarrier(headers)
//	otel.GetTextMapPropagator().Inject(ctx, &c)
//	headers = c
//
// Get is case-insensitive and returns the first header of that name; Set
// replaces every header of that name (case-insensitive) with one, at the
// end.
type HeaderCarrier []consumer.Header

// Get returns the value of the first header named key, or "".
func (c *HeaderCarrier) Get(key string) string {
	for _, h := range *c {
		if strings.EqualFold(h.Key, key) {
			return string(h.Value)
		}
	}
	return ""
}

// Set replaces the headers named key with one holding value.
func (c *HeaderCarrier) Set(key, value string) {
	hs := (*c)[:0:0]
	for _, h := range *c {
		if !strings.EqualFold(h.Key, key) {
			hs = append(hs, h)
		}
	}
	*c = append(hs, consumer.Header{Key: key, Value: []byte(value)})
}

// Keys returns the header names, in order (a repeated name repeats).
func (c *HeaderCarrier) Keys() []string {
	keys := make([]string, len(*c))
	for i, h := range *c {
		keys[i] = h.Key
	}
	return keys
}

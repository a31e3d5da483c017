# justonce developer targets. Tests need real Postgres, Redis and Kafka:
# `make services-up` starts them on loopback (no Docker needed) and writes
# .services.env, which the tests read. NATS is embedded in the tests.

GO ?= go
# staticcheck 2026.2.2 == module version v0.8.2, the newest release, built for Go 1.26.
# (The year-style tag is not resolvable through the module proxy; pin the semver.)
STATICCHECK_VERSION ?= v0.8.2

.PHONY: all services-up services-down services-status test lint bench demo fuzz

all: lint test

services-up:
	bash scripts/services.sh up

services-down:
	bash scripts/services.sh down

services-status:
	bash scripts/services.sh status

test:
	$(GO) test -race -count=1 -timeout 20m ./...

lint:
	@out="$$(gofmt -l .)"; if [ -n "$$out" ]; then echo "gofmt -l: these files need gofmt -w:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...
	$(GO) run honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION) ./...

bench:
	$(GO) test -run '^$$' -bench . -benchmem ./...

demo:
	$(GO) run ./examples/quickstart

# fuzz: placeholder. Fuzz targets are not written yet; once they exist this will run
# each one for a bounded time, e.g. go test -run '^$$' -fuzz '^FuzzX$$' -fuzztime 30s ./pkg
fuzz:
	@echo "fuzz: no fuzz targets yet (placeholder)"

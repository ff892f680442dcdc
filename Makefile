# The test command the README and CI run.
RACE_PKGS := ./master/... ./engine/... ./client/... ./store/... ./tiers/... ./auth/... ./ticket/...

PROTOC_GEN_GO      := google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.12
PROTOC_GEN_GO_GRPC := google.golang.org/grpc/cmd/protoc-gen-go-grpc@v1.5.1
GOBIN_DIR          := $(CURDIR)/.bin

.PHONY: test build vet proto proto-python pytest bench

test: vet
	go test -race -timeout 20m $(RACE_PKGS)
	go test -timeout 30m ./bench/... ./cmd/... ./proto/... ./integration/...
	cd deploy && go test -timeout 10m ./...
	$(RAFT_TEST)
	$(MAKE) pytest

# Our fork of hashicorp/raft (third_party/README.md): its own tests, under
# the race detector. Upstream's suite (which runs every leader write
# through the staged path: its InmemStore stages) is run by hand when the
# fork changes; several of its timing tests fail now and then here as
# they do unchanged upstream, too often for CI.
RAFT_TEST := cd third_party/raft && go test -race -timeout 5m -run "Staged|TestReview" .

# The Python SDK's tests, against a real `tidepool up` and `tidepool agent`.
# Needs Debian's python3-grpcio, python3-protobuf, python3-cbor2,
# python3-xxhash, python3-zmq and python3-msgpack, hence /usr/bin/python3
# rather than whatever is on PATH.
PYTHON := /usr/bin/python3

pytest:
	$(PYTHON) -m unittest discover -s client/python/tests -v

build:
	go build ./...

vet:
	go build ./...
	go vet ./...
	cd deploy && go vet ./...
	cd third_party/raft && go vet .

# Regenerates proto/tidepoolpb. Needs protoc (Debian: protobuf-compiler).
proto:
	GOBIN=$(GOBIN_DIR) go install $(PROTOC_GEN_GO)
	GOBIN=$(GOBIN_DIR) go install $(PROTOC_GEN_GO_GRPC)
	PATH=$(GOBIN_DIR):$$PATH protoc -I proto \
		--go_out=proto/tidepoolpb --go_opt=paths=source_relative \
		--go-grpc_out=proto/tidepoolpb --go-grpc_opt=paths=source_relative \
		proto/*.proto
	$(MAKE) proto-python

# Regenerates the Python SDK's stubs in client/python/tidepool/_proto with
# Debian's protoc and grpc_python_plugin (protobuf-compiler,
# protobuf-compiler-grpc), so they match Debian's python3-protobuf and
# python3-grpcio. protoc writes absolute imports (`import tidepool_pb2`);
# the sed makes them package-relative so the stubs import as
# tidepool._proto.* without touching sys.path.
PY_PROTO_DIR := client/python/tidepool/_proto

proto-python:
	protoc -I proto --python_out=$(PY_PROTO_DIR) \
		--grpc_out=$(PY_PROTO_DIR) --plugin=protoc-gen-grpc=$$(command -v grpc_python_plugin) \
		proto/tidepool.proto proto/agent.proto
	sed -i 's/^import \([a-z_]*_pb2\) as /from . import \1 as /' $(PY_PROTO_DIR)/*_pb2.py $(PY_PROTO_DIR)/*_pb2_grpc.py

bench:
	./docs/benchmarks.sh

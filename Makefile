# The test command the README and CI run.
RACE_PKGS := ./master/... ./engine/... ./client/... ./store/... ./tiers/...

PROTOC_GEN_GO      := google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.12
PROTOC_GEN_GO_GRPC := google.golang.org/grpc/cmd/protoc-gen-go-grpc@v1.5.1
GOBIN_DIR          := $(CURDIR)/.bin

.PHONY: test build vet proto bench

test: vet
	go test -race -timeout 20m $(RACE_PKGS)
	go test -timeout 30m ./cmd/... ./integration/...

build:
	go build ./...

vet:
	go build ./...
	go vet ./...

# Regenerates proto/tidepoolpb. Needs protoc (Debian: protobuf-compiler).
proto:
	GOBIN=$(GOBIN_DIR) go install $(PROTOC_GEN_GO)
	GOBIN=$(GOBIN_DIR) go install $(PROTOC_GEN_GO_GRPC)
	PATH=$(GOBIN_DIR):$$PATH protoc -I proto \
		--go_out=proto/tidepoolpb --go_opt=paths=source_relative \
		--go-grpc_out=proto/tidepoolpb --go-grpc_opt=paths=source_relative \
		proto/*.proto

bench:
	./docs/benchmarks.sh

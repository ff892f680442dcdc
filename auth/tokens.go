package auth

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"sync/atomic"
)

// maxTokensFile bounds the tokens file: it is read whole, on every reload.
const maxTokensFile = 16 << 20

// Tokens maps bearer tokens to identities. It is safe for concurrent use;
// Reload swaps the whole table at once, so a call sees the old file or the
// new one, never a mix.
type Tokens struct {
	path  string
	table atomic.Pointer[map[[sha256.Size]byte]Identity]
}

type tokensFile struct {
	Tokens []tokenEntry `json:"tokens"`
}

type tokenEntry struct {
	Name   string `json:"name"`
	Role   string `json:"role"`
	Tenant string `json:"tenant,omitempty"`
	Token  string `json:"token,omitempty"`
	SHA256 string `json:"sha256,omitempty"`
}

// LoadTokens reads the tokens file at path.
func LoadTokens(path string) (*Tokens, error) {
	t := &Tokens{path: path}
	if err := t.Reload(); err != nil {
		return nil, err
	}
	return t, nil
}

// Reload reads the file again. On an error the table in use stays.
func (t *Tokens) Reload() error {
	table, err := readTokens(t.path)
	if err != nil {
		return err
	}
	t.table.Store(&table)
	return nil
}

// Len is how many tokens the table holds.
func (t *Tokens) Len() int { return len(*t.table.Load()) }

// Lookup returns the identity of token. The table is keyed by the token's
// SHA-256, so the time a lookup takes says nothing of how much of a guess
// matched a real token.
func (t *Tokens) Lookup(token string) (Identity, bool) {
	id, ok := (*t.table.Load())[sha256.Sum256([]byte(token))]
	return id, ok
}

func readTokens(path string) (map[[sha256.Size]byte]Identity, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("tokens file: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("tokens file: %w", err)
	}
	if st.Size() > maxTokensFile {
		return nil, fmt.Errorf("tokens file %s: %d bytes, more than the %d allowed", path, st.Size(), maxTokensFile)
	}
	var file tokensFile
	dec := json.NewDecoder(f)
	dec.DisallowUnknownFields()
	if err := dec.Decode(&file); err != nil {
		return nil, fmt.Errorf("tokens file %s: %w", path, err)
	}
	table := make(map[[sha256.Size]byte]Identity, len(file.Tokens))
	names := map[string]bool{}
	for i, e := range file.Tokens {
		where := fmt.Sprintf("tokens file %s: entry %d (%q)", path, i, e.Name)
		id, sum, err := e.parse()
		if err != nil {
			return nil, fmt.Errorf("%s: %w", where, err)
		}
		if names[e.Name] {
			return nil, fmt.Errorf("%s: the name is used twice", where)
		}
		if _, dup := table[sum]; dup {
			return nil, fmt.Errorf("%s: the same token as an earlier entry", where)
		}
		names[e.Name] = true
		table[sum] = id
	}
	return table, nil
}

func (e tokenEntry) parse() (Identity, [sha256.Size]byte, error) {
	var sum [sha256.Size]byte
	if e.Name == "" {
		return Identity{}, sum, fmt.Errorf("no name")
	}
	role, err := parseRole(e.Role)
	if err != nil {
		return Identity{}, sum, err
	}
	if err := ValidTenant(e.Tenant); err != nil {
		return Identity{}, sum, err
	}
	switch {
	case role == Client && e.Tenant == "":
		return Identity{}, sum, fmt.Errorf("a client token needs a tenant")
	case role != Client && e.Tenant != "":
		return Identity{}, sum, fmt.Errorf("only a client token has a tenant (this one is %s)", role)
	case (e.Token == "") == (e.SHA256 == ""):
		return Identity{}, sum, fmt.Errorf("give exactly one of token and sha256")
	case e.Token != "":
		if len(e.Token) < 16 {
			return Identity{}, sum, fmt.Errorf("the token is %d bytes; at least 16 are needed", len(e.Token))
		}
		sum = sha256.Sum256([]byte(e.Token))
	default:
		b, err := hex.DecodeString(strings.TrimSpace(e.SHA256))
		if err != nil || len(b) != sha256.Size {
			return Identity{}, sum, fmt.Errorf("sha256 must be %d hex digits", 2*sha256.Size)
		}
		copy(sum[:], b)
	}
	return Identity{Name: e.Name, Role: role, Tenant: e.Tenant}, sum, nil
}

// MaxTenant bounds a tenant's name.
const MaxTenant = 64

// ValidTenant checks a tenant name: up to MaxTenant bytes of letters,
// digits, '-', '_' and '.'; empty is the pool's only tenant when there are
// no tokens.
func ValidTenant(s string) error {
	if len(s) > MaxTenant {
		return fmt.Errorf("tenant %q: longer than %d bytes", s, MaxTenant)
	}
	for _, c := range s {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_' || c == '.') {
			return fmt.Errorf("tenant %q: only letters, digits, '-', '_' and '.' are allowed", s)
		}
	}
	return nil
}

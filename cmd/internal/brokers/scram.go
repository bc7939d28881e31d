package brokers

// A SCRAM client (RFC 5802) for sarama's SASL/SCRAM-SHA-256 and -512,
// which sarama leaves to its user: kafka://user:password@host?sasl=scram-sha-512.

import (
	"crypto/hmac"
	"crypto/pbkdf2"
	"crypto/rand"
	"crypto/sha256"
	"crypto/sha512"
	"crypto/subtle"
	"encoding/base64"
	"errors"
	"fmt"
	"hash"
	"strconv"
	"strings"

	"github.com/IBM/sarama"
)

// errSCRAM is what the SCRAM client's errors wrap. They never hold the
// password.
var errSCRAM = errors.New("brokers: SCRAM")

// scramClient is one SCRAM conversation: sarama.SCRAMClient.
type scramClient struct {
	hash func() hash.Hash
	// nonce makes the client's nonce (tests give a fixed one).
	nonce func() (string, error)

	user, password, authzID string
	step                    int
	clientFirstBare, gs2    string
	serverSignature         []byte
	done                    bool
}

var _ sarama.SCRAMClient = (*scramClient)(nil)

// newSCRAM makes the SCRAM clients of mechanism, for
// sarama.Config.Net.SASL.SCRAMClientGeneratorFunc.
func newSCRAM(mechanism sarama.SASLMechanism) func() sarama.SCRAMClient {
	h := sha256.New
	if mechanism == sarama.SASLTypeSCRAMSHA512 {
		h = sha512.New
	}
	return func() sarama.SCRAMClient { return &scramClient{hash: h, nonce: randomNonce} }
}

func randomNonce() (string, error) {
	b := make([]byte, 24)
	if _, err := rand.Read(b); err != nil {
		return "", err
	}
	return base64.RawStdEncoding.EncodeToString(b), nil
}

// saslName escapes a name for a SCRAM attribute.
func saslName(s string) string {
	return strings.NewReplacer("=", "=3D", ",", "=2C").Replace(s)
}

func (c *scramClient) Begin(user, password, authzID string) error {
	c.user, c.password, c.authzID = user, password, authzID
	c.step, c.done = 0, false
	return nil
}

func (c *scramClient) Done() bool { return c.done }

func (c *scramClient) Step(challenge string) (string, error) {
	c.step++
	switch c.step {
	case 1:
		nonce, err := c.nonce()
		if err != nil {
			return "", fmt.Errorf("%w: making a nonce: %v", errSCRAM, err)
		}
		c.gs2 = "n,,"
		if c.authzID != "" {
			c.gs2 = "n,a=" + saslName(c.authzID) + ","
		}
		c.clientFirstBare = "n=" + saslName(c.user) + ",r=" + nonce
		return c.gs2 + c.clientFirstBare, nil
	case 2:
		return c.clientFinal(challenge)
	case 3:
		c.done = true
		attrs := scramAttrs(challenge)
		if e, ok := attrs["e"]; ok {
			return "", fmt.Errorf("%w: the server refused the login: %s", errSCRAM, e)
		}
		got, err := base64.StdEncoding.DecodeString(attrs["v"])
		if err != nil || subtle.ConstantTimeCompare(got, c.serverSignature) != 1 {
			return "", fmt.Errorf("%w: the server's signature does not prove it knows the password", errSCRAM)
		}
		return "", nil
	}
	return "", fmt.Errorf("%w: the conversation is over", errSCRAM)
}

// clientFinal answers the server's first message with the proof.
func (c *scramClient) clientFinal(serverFirst string) (string, error) {
	attrs := scramAttrs(serverFirst)
	nonce, salt64, iters := attrs["r"], attrs["s"], attrs["i"]
	_, clientNonce, _ := strings.Cut(c.clientFirstBare, ",r=")
	if !strings.HasPrefix(nonce, clientNonce) || len(nonce) == len(clientNonce) {
		return "", fmt.Errorf("%w: the server's nonce does not extend the client's", errSCRAM)
	}
	salt, err := base64.StdEncoding.DecodeString(salt64)
	if err != nil || len(salt) == 0 {
		return "", fmt.Errorf("%w: the server's salt cannot be read", errSCRAM)
	}
	n, err := strconv.Atoi(iters)
	if err != nil || n < 1 || n > 1_000_000 {
		return "", fmt.Errorf("%w: the server's iteration count cannot be used", errSCRAM)
	}
	salted, err := pbkdf2.Key(c.hash, c.password, salt, n, c.hash().Size())
	if err != nil {
		return "", fmt.Errorf("%w: %v", errSCRAM, err)
	}
	clientKey := c.mac(salted, "Client Key")
	h := c.hash()
	h.Write(clientKey)
	storedKey := h.Sum(nil)
	withoutProof := "c=" + base64.StdEncoding.EncodeToString([]byte(c.gs2)) + ",r=" + nonce
	authMessage := c.clientFirstBare + "," + serverFirst + "," + withoutProof
	proof := c.mac(storedKey, authMessage)
	for i := range proof {
		proof[i] ^= clientKey[i]
	}
	c.serverSignature = c.mac(c.mac(salted, "Server Key"), authMessage)
	return withoutProof + ",p=" + base64.StdEncoding.EncodeToString(proof), nil
}

func (c *scramClient) mac(key []byte, msg string) []byte {
	m := hmac.New(c.hash, key)
	m.Write([]byte(msg))
	return m.Sum(nil)
}

// scramAttrs reads a SCRAM message's attributes, a=value each.
func scramAttrs(msg string) map[string]string {
	out := map[string]string{}
	for _, part := range strings.Split(msg, ",") {
		if k, v, ok := strings.Cut(part, "="); ok && len(k) == 1 {
			if _, seen := out[k]; !seen {
				out[k] = v
			}
		}
	}
	return out
}

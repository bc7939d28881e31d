package natsjs

import (
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"sort"
	"strings"
	"unicode/utf8"

	wmnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/pgsaga/pgsaga/steps/broker"
)

// Headers of the wire format. A message travels as a NATS message whose
// data is its payload, byte for byte, and whose headers are its UUID
// (HeaderUUID, Watermill's own) and its metadata, one header per entry, so
// that any NATS client reads it. What a header cannot carry as it is (a key
// NATS does not allow, a value with line breaks, control characters or
// surrounding spaces, which nats.go would change, a key of NATS's own such
// as Nats-Expected-Stream, which would change how JetStream stores the
// message) travels in HeaderEncoded instead: base64url of a JSON object
// {"uuid": …, "metadata": {…}} holding just those entries, each string in
// base64 itself, so that any bytes survive. Nothing is lost or altered on
// the way.
const (
	HeaderUUID    = wmnats.WatermillUUIDHdr
	HeaderEncoded = "Pgsaga-Encoded"
)

// codec is the wire format: watermill-nats' Marshaler for the publisher
// and its JetStream subscriber's Unmarshaler.
type codec struct{}

var (
	_ wmnats.Marshaler = codec{}
)

// encoded is HeaderEncoded's JSON: every string in base64 (JSON strings
// cannot hold bytes that are not UTF-8).
type encoded struct {
	UUID     []byte            `json:"uuid,omitempty"`
	Metadata map[string][]byte `json:"metadata,omitempty"`
}

// Marshal implements watermill-nats' Marshaler.
func (codec) Marshal(topic string, msg *message.Message) (*nats.Msg, error) {
	h := nats.Header{}
	var enc encoded
	if headerValue(msg.UUID) {
		h.Set(HeaderUUID, msg.UUID)
	} else {
		enc.UUID = []byte(msg.UUID)
	}
	h.Set(jetstream.MsgIDHeader, MsgID(msg.UUID))
	for k, v := range msg.Metadata {
		if headerKey(k) && headerValue(v) {
			h.Set(k, v)
			continue
		}
		if enc.Metadata == nil {
			enc.Metadata = map[string][]byte{}
		}
		enc.Metadata[base64.StdEncoding.EncodeToString([]byte(k))] = []byte(v)
	}
	if enc.UUID != nil || enc.Metadata != nil {
		b, err := json.Marshal(enc)
		if err != nil {
			return nil, fmt.Errorf("natsjs: encoding message %s: %w", msg.UUID, err)
		}
		h.Set(HeaderEncoded, base64.RawURLEncoding.EncodeToString(b))
	}
	if n := headerSize(h); n > MaxHeaderBytes {
		return nil, fmt.Errorf("%w: message %s would carry %d bytes of headers (its metadata), JetStream takes %d", ErrHeadersTooLarge, MsgID(msg.UUID), n, MaxHeaderBytes)
	}
	return &nats.Msg{Subject: topic, Data: msg.Payload, Header: h}, nil
}

// MaxHeaderBytes is the most header bytes JetStream stores with a
// message (64 KiB; "header size exceeds maximum allowed" beyond).
const MaxHeaderBytes = 64 * 1024

// headerSize is the size of h on the wire, as nats.go writes it.
func headerSize(h nats.Header) int {
	n := len("NATS/1.0\r\n\r\n")
	for k, vs := range h {
		for _, v := range vs {
			n += len(k) + len(v) + len(": \r\n")
		}
	}
	return n
}

// MsgID is the JetStream deduplication id (Nats-Msg-Id) of a message with
// this UUID: the UUID itself, or, for one a header cannot carry as it is,
// "sha256:" and its hash.
func MsgID(uuid string) string {
	if headerValue(uuid) && uuid != "" {
		return uuid
	}
	sum := sha256.Sum256([]byte(uuid))
	return "sha256:" + hex.EncodeToString(sum[:])
}

// Unmarshal implements watermill-nats' JetStream Unmarshaler. It never
// fails: a message it cannot read whole is handed out marked malformed
// (broker.MalformedKey), with what could be read. A message with no
// Watermill UUID (published by another client) takes its Nats-Msg-Id, or
// else "nats:<stream>:<sequence>", which stays the same on redelivery.
func (codec) Unmarshal(m jetstream.Msg) (*message.Message, error) {
	var (
		md    = message.Metadata{}
		uuid  string
		flaws []string
	)
	h := m.Headers()
	keys := make([]string, 0, len(h))
	for k := range h {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		vs := h[k]
		if len(vs) != 1 {
			flaws = append(flaws, fmt.Sprintf("header %q has %d values", k, len(vs)))
			if len(vs) == 0 {
				continue
			}
		}
		switch {
		case k == HeaderUUID:
			uuid = vs[0]
		case k == HeaderEncoded:
			raw, err := base64.RawURLEncoding.DecodeString(vs[0])
			var enc encoded
			if err == nil {
				err = json.Unmarshal(raw, &enc)
			}
			if err != nil {
				flaws = append(flaws, "header "+HeaderEncoded+" cannot be decoded: "+err.Error())
				continue
			}
			if enc.UUID != nil {
				uuid = string(enc.UUID)
			}
			for ek, ev := range enc.Metadata {
				k, err := base64.StdEncoding.DecodeString(ek)
				if err != nil {
					flaws = append(flaws, "header "+HeaderEncoded+" holds a key that cannot be decoded: "+err.Error())
					continue
				}
				md[string(k)] = string(ev)
			}
		case natsHeader(k):
			// JetStream's own (Nats-Msg-Id, …), not the message's.
		default:
			if _, taken := md[k]; !taken { // an encoded entry wins
				md[k] = vs[0]
			}
		}
	}
	if uuid == "" {
		uuid = h.Get(jetstream.MsgIDHeader)
	}
	if uuid == "" {
		if meta, err := m.Metadata(); err == nil {
			uuid = fmt.Sprintf("nats:%s:%d", meta.Stream, meta.Sequence.Stream)
		} else {
			flaws = append(flaws, "it has no id, and its stream position is unknown: "+err.Error())
		}
	}
	msg := message.NewMessage(uuid, m.Data())
	msg.Metadata = md
	if len(flaws) > 0 {
		msg.Metadata.Set(broker.MalformedKey, strings.Join(flaws, "; "))
	}
	return msg, nil
}

// headerKey reports whether k can be a NATS header key as it is, and is
// none of the wire format's, NATS's own, or one nats.go reads (Status and
// Description: with no data, nats.go takes the message for one of the
// server's and never hands it out).
func headerKey(k string) bool {
	if k == "" || k == HeaderUUID || k == HeaderEncoded || strings.EqualFold(k, "Status") || strings.EqualFold(k, "Description") || mentionsNATS(k) {
		return false
	}
	for i := 0; i < len(k); i++ {
		c := k[i]
		if c < 33 || c > 126 || strings.IndexByte(`"()/,:;<=>?@[\]{}`, c) >= 0 {
			return false
		}
	}
	return true
}

// headerValue reports whether v travels in a NATS header unchanged:
// UTF-8 with no control characters (nats.go turns line breaks into
// spaces) and no surrounding spaces (it trims them), and is harmless to
// JetStream (see mentionsNATS).
func headerValue(v string) bool {
	if !utf8.ValidString(v) || strings.TrimSpace(v) != v || mentionsNATS(v) {
		return false
	}
	for _, r := range v {
		if r < 0x20 || r == 0x7f {
			return false
		}
	}
	return true
}

// natsHeader reports whether k is in NATS's own header space (Nats-…),
// whose entries change how the server handles a message.
func natsHeader(k string) bool { return len(k) >= 5 && strings.EqualFold(k[:5], "nats-") }

// mentionsNATS reports whether s holds "Nats-" anywhere, in any case. The
// server finds a header of its own (Nats-Msg-Id, …) by the first place the
// headers hold its name, and ignores it unless that place starts a line:
// a key or value holding the name, written before the real header (nats.go
// writes headers in no fixed order), would turn off deduplication. (The
// encoded header cannot hold it: base64url of JSON text has no '-'.)
func mentionsNATS(s string) bool {
	for i := 0; i+5 <= len(s); i++ {
		if strings.EqualFold(s[i:i+5], "nats-") {
			return true
		}
	}
	return false
}

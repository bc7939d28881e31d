package natsjs_test

import (
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testnats"
	"github.com/pgsaga/pgsaga/steps/broker"
	"github.com/pgsaga/pgsaga/steps/broker/natsjs"
)

// delivered is a core NATS message as the JetStream subscriber sees one.
type delivered struct {
	jetstream.Msg
	m *nats.Msg
}

func (d delivered) Headers() nats.Header { return d.m.Header }
func (d delivered) Data() []byte         { return d.m.Data }
func (d delivered) Metadata() (*jetstream.MsgMetadata, error) {
	return &jetstream.MsgMetadata{Stream: "s", Sequence: jetstream.SequencePair{Stream: 7}}, nil
}

// Whatever a message holds, it crosses a NATS server unchanged: its id,
// its payload byte for byte and every metadata entry, through nats.go's
// header encoding (which trims values and turns line breaks into spaces)
// and the server.
func FuzzWireRoundTrip(f *testing.F) {
	f.Add("7b0c3a1e-uuid", "reason", "a\r\nb", []byte("{}"))
	f.Add("id with space ", " padded key", "  padded  ", []byte{0, 0xff})
	f.Add("x", "Nats-Expected-Stream", "other", []byte(nil))
	f.Add("\x00\xff", "a:b", "\t", []byte("p"))
	f.Add("ok", "", "", []byte(""))
	f.Add("ok", natsjs.HeaderEncoded, "spoof", []byte(""))
	f.Add("ok", natsjs.HeaderUUID, "spoof", []byte(""))
	f.Add("ok", "naïve", "日本\u0085", []byte(""))
	f.Add("ok", "Status", "400", []byte(""))
	f.Add("ok", "X-Nats-Msg-Id", "copied from Nats-Msg-Id", []byte("p"))
	f.Add("id-NATS-msg-id", "description", "no messages", []byte(nil))
	nc, _ := testnats.Connect(f)
	subject := "pgsagatest.wire." + nats.NewInbox()[7:]
	sub, err := nc.SubscribeSync(subject)
	require.NoError(f, err)
	codec := natsjs.Codec{}
	f.Fuzz(func(t *testing.T, uuid, key, value string, payload []byte) {
		if uuid == "" {
			t.Skip("the transport refuses an empty id before anything is relayed")
		}
		msg := message.NewMessage(uuid, payload)
		msg.Metadata = message.Metadata{key: value, "plain": "value"}
		nm, err := codec.Marshal(subject, msg)
		require.NoError(t, err)
		require.NoError(t, nc.PublishMsg(nm))
		got, err := sub.NextMsg(5 * time.Second)
		require.NoError(t, err)
		back, err := codec.Unmarshal(delivered{m: got})
		require.NoError(t, err)
		require.Empty(t, broker.Malformed(back))
		require.Equal(t, msg.UUID, back.UUID)
		require.Equal(t, string(msg.Payload), string(back.Payload))
		require.Equal(t, msg.Metadata, back.Metadata)
		require.Equal(t, natsjs.MsgID(uuid), got.Header.Get(jetstream.MsgIDHeader), "the deduplication id")
		// Nothing but the deduplication id names a header of NATS's own
		// (JetStream would miss it), and nothing could pass for a
		// message of the server's (nats.go would never hand it out).
		for k, vs := range nm.Header {
			for _, v := range vs {
				if k != jetstream.MsgIDHeader {
					require.NotContains(t, strings.ToLower(k+": "+v), "nats-", "header %q", k)
				}
			}
			require.False(t, strings.EqualFold(k, "Status") || strings.EqualFold(k, "Description"), "header %q", k)
		}
	})
}

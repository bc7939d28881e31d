package natsjs

import (
	"errors"

	"github.com/pgsaga/pgsaga/internal/brokers/brokerurl"
)

// The errors the package returns, for errors.Is.
var (
	// ErrUnsupportedTopic is returned for a topic that is no usable NATS
	// subject: one starting with "$" (NATS's own subjects) or with an empty
	// token ("a..b", ".a", "a.").
	ErrUnsupportedTopic = errors.New("natsjs: the topic cannot be a NATS subject")
	// ErrHeadersTooLarge is returned for a message whose metadata
	// JetStream would not store (over MaxHeaderBytes); it is permanent.
	ErrHeadersTooLarge = errors.New("natsjs: the message's headers are larger than JetStream takes")
	// ErrInvalidURL is returned when Config.URL cannot be parsed, or holds
	// a password outside its userinfo; the error's text holds no part of
	// the URL.
	ErrInvalidURL = brokerurl.ErrUnparseable
)

// Command trip runs a trip saga whose steps call outside services over
// HTTP: book a hotel, then charge a card; a declined card cancels the
// booking. Each call is made once per command, whatever is redelivered,
// through steps.Call. The hotel and the bank are test servers started
// in the process; they count what they did, and refuse a second booking
// or charge under one Idempotency-Key.
//
//	DATABASE_URL=postgres://… go run .
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"sync"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/steps"
)

// Trip is the saga's trigger, its data and its steps' command.
type Trip struct {
	ID    string `json:"id"`
	Card  string `json:"card"`
	Hotel string `json:"hotel,omitempty"` // the booking, once made
}

func (Trip) MessageType() string { return "trip.Trip" }

// Booked is the hotel step's reply.
type Booked struct {
	Hotel string `json:"hotel"`
}

func (Booked) MessageType() string { return "trip.Booked" }

// Booking and Payment are what the services answer.
type Booking struct {
	ID string `json:"id"`
}
type Payment struct {
	Declined bool `json:"declined"`
}

var hotelURL, bankURL string

func main() {
	ctx := context.Background()
	services := startServices()
	defer services.Close()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	check(err)
	client, err := saga.NewClient(pool, saga.ClientConfig{FinishedChannel: "trip_finished", Logger: slog.New(slog.DiscardHandler)})
	check(err)
	_, err = client.Migrate(ctx)
	check(err)

	// <!-- trip-step -->
	book := steps.Define("hotel.book", "hotel.book", func(ctx context.Context, tx *steps.Tx, t Trip) (steps.Message, error) {
		b, err := steps.Call(ctx, tx, func(ctx context.Context, key string) (b Booking, err error) {
			err = post(ctx, hotelURL+"/bookings", key, t, &b) // the key goes as Idempotency-Key
			return b, err
		})
		if err != nil {
			return nil, err // the call runs outside the transaction; the step runs again with its answer
		}
		return Booked{Hotel: b.ID}, nil
	})
	// <!-- /trip-step -->
	cancel := steps.Define("hotel.cancel", "hotel.cancel", func(ctx context.Context, tx *steps.Tx, t Trip) (steps.Message, error) {
		_, err := steps.Call(ctx, tx, func(ctx context.Context, key string) (Booking, error) {
			return Booking{}, post(ctx, hotelURL+"/cancellations", key, t, nil)
		})
		return nil, err
	})
	charge := steps.Define("bank.charge", "bank.charge", func(ctx context.Context, tx *steps.Tx, t Trip) (steps.Message, error) {
		p, err := steps.Call(ctx, tx, func(ctx context.Context, key string) (p Payment, err error) {
			err = post(ctx, bankURL+"/charges", key, t, &p)
			return p, err
		})
		if err != nil {
			return nil, err
		}
		if p.Declined {
			return nil, steps.Fail(nil, "card declined") // final: the saga cancels the booking
		}
		return nil, nil
	})
	same := func(t Trip) Trip { return t }
	check(client.Register(saga.MustDefine(saga.Spec[Trip]{Name: "trip",
		Trigger: saga.On("trips", func(t Trip) (string, Trip, error) { return t.ID, t, nil }),
		Steps: []saga.Step[Trip]{
			{Name: "hotel", Action: saga.OnReply(saga.Send(book, same), func(t *Trip, b Booked) error { t.Hotel = b.Hotel; return nil }),
				Compensation: saga.Send(cancel, same)},
			{Name: "charge", Action: saga.Send(charge, same)},
		}})))
	check(client.AddSteps(book, cancel, charge))
	check(client.Start(ctx))
	defer client.Stop(context.WithoutCancel(ctx))

	for _, trip := range []Trip{{ID: "trip-1", Card: "good"}, {ID: "trip-2", Card: "empty"}} {
		tx, err := pool.Begin(ctx)
		check(err)
		id, err := client.StartTx(ctx, saga.PgxTx(tx), "trip", trip)
		check(err)
		check(tx.Commit(ctx))
		inst, err := client.WaitFinished(ctx, id)
		check(err)
		var data Trip
		check(json.Unmarshal(inst.Data, &data))
		fmt.Printf("%s: %s, hotel %s", trip.ID, inst.Status, data.Hotel)
		if inst.FailureReason != "" {
			fmt.Printf(" (%s)", inst.FailureReason)
		}
		fmt.Println()
	}
	fmt.Println(services)
}

// post sends in as JSON with the Idempotency-Key header and decodes the
// answer into out (unless nil). A 5xx, or no answer, is an error: the
// outcome is unknown, and the call is made again with the same key.
func post(ctx context.Context, url, key string, in, out any) error {
	body, err := json.Marshal(in)
	if err != nil {
		return err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Idempotency-Key", key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: %s", url, resp.Status)
	}
	if out == nil {
		return nil
	}
	return json.NewDecoder(resp.Body).Decode(out)
}

// services are the hotel and the bank: each request's effect happens once
// per Idempotency-Key (a second request with a key is answered as the
// first was), and they count requests and effects.
type services struct {
	mu       sync.Mutex
	answers  map[string][]byte // by path and key
	requests int
	effects  map[string]int // by path
	servers  []*httptest.Server
}

func startServices() *services {
	s := &services{answers: map[string][]byte{}, effects: map[string]int{}}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /bookings", s.once(func(t Trip) any { return Booking{ID: "room-" + t.ID} }))
	mux.HandleFunc("POST /cancellations", s.once(func(t Trip) any { return struct{}{} }))
	mux.HandleFunc("POST /charges", s.once(func(t Trip) any { return Payment{Declined: t.Card == "empty"} }))
	srv := httptest.NewServer(mux)
	s.servers = append(s.servers, srv)
	hotelURL, bankURL = srv.URL, srv.URL
	return s
}

func (s *services) once(effect func(Trip) any) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		var t Trip
		if err := json.NewDecoder(r.Body).Decode(&t); err != nil {
			http.Error(w, "bad trip", http.StatusBadRequest)
			return
		}
		s.mu.Lock()
		defer s.mu.Unlock()
		s.requests++
		id := r.URL.Path + " " + r.Header.Get("Idempotency-Key")
		if _, done := s.answers[id]; !done {
			s.answers[id], _ = json.Marshal(effect(t))
			s.effects[r.URL.Path]++
		}
		_, _ = w.Write(s.answers[id])
	}
}

func (s *services) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return fmt.Sprintf("hotel: %d booked, %d cancelled; bank: %d charges; %d requests",
		s.effects["/bookings"], s.effects["/cancellations"], s.effects["/charges"], s.requests)
}

func (s *services) Close() {
	for _, srv := range s.servers {
		srv.Close()
	}
}

func check(err error) {
	if err != nil {
		log.Fatal(err)
	}
}

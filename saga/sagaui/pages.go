package sagaui

// The web view's pages: what each reads, through the code the other
// subcommands use, and what it shows.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"html/template"
	"maps"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"

	"github.com/pgsaga/pgsaga/internal/metadata"
	"github.com/pgsaga/pgsaga/internal/present"
	"github.com/pgsaga/pgsaga/internal/termsafe"
	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/saga/delivery"
)

// pageTimeout bounds what one page reads.
const pageTimeout = 15 * time.Second

var templateFuncs = template.FuncMap{
	"px":  func(f float64) string { return strconv.FormatFloat(f, 'f', 1, 64) },
	"add": func(a, b float64) float64 { return a + b },
	"mid": func(a, b float64) float64 { return (a + b) / 2 },
}

// --- the sagas -------------------------------------------------------------

type sagasView struct {
	Statuses  []statusOption
	Types     []string
	Saga      string
	OlderThan string
	Limit     int
	Total     int // instances of the chosen saga (or all), every status
	Rows      []sagaRow
	NextHref  string // the next page, if this one is full
	Paged     bool   // this page comes after others
	Filtered  bool
}

type statusOption struct {
	Name    string
	Count   int
	Checked bool
	Href    string
}

type sagaRow struct {
	ID, Href, Saga, Status, Step, Phase string
	Attempt                             string
	Age, Updated, UpdatedAt             string
	Reason                              string
}

func (u *Handler) sagas(w http.ResponseWriter, r *http.Request) error {
	ctx, cancel := context.WithTimeout(r.Context(), pageTimeout)
	defer cancel()
	q := r.URL.Query()
	v := sagasView{Saga: strings.TrimSpace(q.Get("saga")), OlderThan: strings.TrimSpace(q.Get("older-than")), Limit: 100}
	var olderThan time.Duration
	if v.OlderThan != "" {
		d, err := time.ParseDuration(v.OlderThan)
		if err != nil {
			return badRequest("Bad filter: older-than %q is not a duration; write it like 90s, 10m or 2h.", v.OlderThan)
		}
		olderThan = d
	}
	if s := strings.TrimSpace(q.Get("limit")); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil {
			return badRequest("Bad filter: limit %q is not a whole number.", s)
		}
		v.Limit = n
	}
	var status []string
	for _, s := range q["status"] {
		for _, part := range strings.Split(s, ",") {
			if part = strings.TrimSpace(part); part != "" {
				status = append(status, part)
			}
		}
	}
	f, err := present.SagaFilter(status, v.Saga, olderThan, v.Limit)
	if err != nil {
		return badRequest("Bad filter: %v.", err)
	}
	if f.After, err = afterOf(q); err != nil {
		return err
	}
	v.Paged = f.After != nil
	list, err := u.client.List(ctx, f)
	if err != nil {
		return err
	}
	counts, err := u.client.Counts(ctx)
	if err != nil {
		return err
	}
	for typ := range counts {
		v.Types = append(v.Types, typ)
	}
	if v.Saga != "" && counts[v.Saga] == nil {
		v.Types = append(v.Types, v.Saga)
	}
	slices.Sort(v.Types)
	for _, st := range present.Statuses {
		n := 0
		for typ, byStatus := range counts {
			if v.Saga == "" || typ == v.Saga {
				n += byStatus[st]
			}
		}
		v.Total += n
		link := url.Values{"status": {string(st)}}
		if v.Saga != "" {
			link.Set("saga", v.Saga)
		}
		v.Statuses = append(v.Statuses, statusOption{Name: string(st), Count: n, Checked: slices.Contains(f.Statuses, st), Href: "/sagas?" + link.Encode()})
	}
	v.Filtered = len(f.Statuses) > 0 || v.Saga != "" || olderThan > 0
	for _, in := range list {
		now := present.DBNow(in)
		v.Rows = append(v.Rows, sagaRow{ID: in.ID.String(), Href: "/sagas/" + in.ID.String(), Saga: in.Type, Status: string(in.Status),
			Step: present.Dash(in.Step), Phase: present.Dash(string(in.Phase)), Attempt: present.Attempt(in.Attempt), Age: present.Age(now.Sub(in.CreatedAt)),
			Updated: present.Age(now.Sub(in.UpdatedAt)) + " ago", UpdatedAt: stamp(in.UpdatedAt), Reason: present.Clip(present.OneLine(in.FailureReason), 140)})
	}
	if len(list) == f.Limit {
		next := url.Values{}
		for k, vs := range q {
			if k != "after" && k != "after-at" {
				next[k] = vs
			}
		}
		last := list[len(list)-1]
		next.Set("after", last.ID.String())
		next.Set("after-at", last.UpdatedAt.UTC().Format(time.RFC3339Nano))
		v.NextHref = "/sagas?" + next.Encode()
	}
	u.render(w, r, http.StatusOK, pageSagas, "sagas", v)
	return nil
}

// afterOf is the instance a page of the sagas listing comes after (its
// after and after-at parameters: the last of the page before), nil for
// the first page.
func afterOf(q url.Values) (*saga.Instance, error) {
	id, at := q.Get("after"), q.Get("after-at")
	if id == "" && at == "" {
		return nil, nil
	}
	after := &saga.Instance{}
	var err error
	if after.ID, err = uuid.Parse(id); err != nil {
		return nil, badRequest("Bad page: after %q is not a saga id (a UUID).", id)
	}
	if after.UpdatedAt, err = time.Parse(time.RFC3339Nano, at); err != nil {
		return nil, badRequest("Bad page: after-at %q is not a time like 2026-01-02T03:04:05.123456Z.", at)
	}
	return after, nil
}

// find shows the saga of a name started by a business key (the key its
// trigger gave: one instance per key).
func (u *Handler) find(w http.ResponseWriter, r *http.Request) error {
	ctx, cancel := context.WithTimeout(r.Context(), pageTimeout)
	defer cancel()
	name, key := strings.TrimSpace(r.URL.Query().Get("saga")), r.URL.Query().Get("key")
	if name == "" || key == "" {
		return badRequest("Bad search: give a saga and a business key.")
	}
	id := saga.ID(name, key)
	if _, err := u.client.Get(ctx, id); errors.Is(err, saga.ErrNoSuchSaga) {
		return notFound("No saga %s has the business key %q.", name, key)
	} else if err != nil {
		return err
	}
	http.Redirect(w, r, u.href("/sagas/"+id.String()), http.StatusSeeOther)
	return nil
}

func stamp(t time.Time) string { return t.UTC().Format("2006-01-02 15:04:05.000 UTC") }

// --- one saga --------------------------------------------------------------

type sagaView struct {
	ID, Type, Status, Step, Phase, Attempt string
	Version, Generation                    int
	Reason                                 string
	Started, Updated, Finished, Took       string
	Deadline, Correlation                  string
	Data                                   string
	Timeline                               *svgTimeline
	Entries                                []entryRow
	DeadLetters                            []deadLetterRow
	DeadLettersNote                        string
	Request                                *requestView
	CanRetry, CanCancel                    bool
	RetryHint, CancelHint                  string
}

func (v sagaView) title() string { return "Saga " + v.ID }

func (v sagaView) refresh() int {
	if v.Request != nil && v.Request.Pending {
		return 2
	}
	return 0
}

type entryRow struct {
	Seq                              int
	Ms                               string
	Kind, Step, Phase, Attempt       string
	MessageID, Detail, KindClass, At string
}

type requestView struct {
	ID, Kind, RequestedAt, DoneAt, Outcome, Detail, Reason string
	Pending                                                bool
}

// sagaID is the saga id in the request's path, or a 400.
func sagaID(r *http.Request) (uuid.UUID, error) {
	raw := r.PathValue("id")
	id, err := uuid.Parse(raw)
	if err != nil {
		return uuid.Nil, badRequest("%q is not a saga id: a saga id is a UUID, like 5f0c3a8e-2b1d-4c7e-9a44-1d2e3f405162.", raw)
	}
	return id, nil
}

func noSuchSaga(id uuid.UUID) error {
	return notFound("No saga has the id %s in this database. A finished saga is deleted once retention prunes it; or the id belongs to another database.", id)
}

func (u *Handler) saga(w http.ResponseWriter, r *http.Request) error {
	id, err := sagaID(r)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(r.Context(), pageTimeout)
	defer cancel()
	var req *requestView
	if raw := r.URL.Query().Get("request"); raw != "" {
		reqID, err := uuid.Parse(raw)
		if err != nil {
			return badRequest("%q is not a request id (a UUID).", raw)
		}
		statuses, err := u.client.RequestStatuses(ctx, []uuid.UUID{reqID})
		got, found := statuses[reqID]
		if err == nil && (!found || got.SagaID != id) {
			return notFound("No request %s was made for saga %s.", reqID, id)
		}
		if err != nil {
			return err
		}
		req = &requestView{ID: got.ID.String(), Kind: string(got.Kind), RequestedAt: stamp(got.RequestedAt), Pending: got.DoneAt == nil,
			Outcome: got.Outcome, Detail: got.Detail, Reason: got.Reason}
		if got.DoneAt != nil {
			req.DoneAt = stamp(*got.DoneAt)
		}
	}
	in, err := u.client.Get(ctx, id)
	if errors.Is(err, saga.ErrNoSuchSaga) {
		return noSuchSaga(id)
	}
	if err != nil {
		return err
	}
	now := present.DBNow(in)
	v := sagaView{ID: in.ID.String(), Type: in.Type, Version: in.DefinitionVersion, Status: string(in.Status), Step: present.Dash(in.Step),
		Phase: present.Dash(string(in.Phase)), Attempt: present.Attempt(in.Attempt), Generation: in.Generation, Reason: in.FailureReason,
		Started: stamp(in.CreatedAt), Updated: stamp(in.UpdatedAt) + " (" + present.Age(now.Sub(in.UpdatedAt)) + " ago)",
		Correlation: in.CorrelationID, Data: prettyJSON(in.Data), Request: req}
	if in.FinishedAt != nil {
		v.Finished = stamp(*in.FinishedAt)
		v.Took = ms(in.FinishedAt.Sub(in.CreatedAt))
	}
	if in.DeadlineAt != nil && !in.Status.Terminal() {
		v.Deadline = stamp(*in.DeadlineAt)
		if d := in.DeadlineAt.Sub(now); d > 0 {
			v.Deadline += " (in " + present.Age(d) + ")"
		} else {
			v.Deadline += " (" + present.Age(-d) + " overdue)"
		}
	}
	switch in.Status {
	case saga.StatusFailed:
		v.CanRetry, v.RetryHint = true, "sends the failed compensation again under a fresh key"
		v.CancelHint = "a parked saga cannot be cancelled: fix the cause, then retry"
	case saga.StatusRunning:
		v.CanRetry, v.RetryHint = true, "sends the command in flight again"
		v.CanCancel, v.CancelHint = true, "compensates the step in flight and those before it"
	case saga.StatusCompensating:
		v.CanRetry, v.RetryHint = true, "sends the compensation in flight again"
		v.CancelHint = "it is compensating already"
	default:
		v.RetryHint = "a " + string(in.Status) + " saga is finished"
		v.CancelHint = v.RetryHint
	}
	for _, h := range in.History {
		v.Entries = append(v.Entries, entryRow{Seq: h.Seq, Ms: fmt.Sprintf("%.1f", float64(h.At.Sub(in.CreatedAt).Microseconds())/1000),
			Kind: h.Kind, KindClass: kindClass(h.Kind), Step: present.Dash(h.Step), Phase: present.Dash(string(h.Phase)), Attempt: present.Attempt(h.Attempt),
			MessageID: h.MessageID, Detail: h.Detail, At: stamp(h.At)})
	}
	v.Timeline = buildTimeline(in, now)
	dead, scannedAll, unknown, err := u.sagaDeadLetters(ctx, id)
	if err != nil {
		return err
	}
	for _, d := range dead {
		v.DeadLetters = append(v.DeadLetters, deadLetterRowOf(d, d.PayloadPreview, now, r.URL.RequestURI()))
	}
	if !scannedAll {
		v.DeadLettersNote = fmt.Sprintf("Only the oldest %s dead letters were searched for this saga.", thousands(deadLetterScan))
	}
	if unknown > 0 {
		v.DeadLettersNote = strings.TrimSpace(v.DeadLettersNote + fmt.Sprintf(" %d dead letter%s searched had metadata too large to list (over %s bytes), so whether they name this saga is not known: the Dead letters page links to each.",
			unknown, present.Plural(unknown), thousands(delivery.DeadLetterListText)))
	}
	u.render(w, r, http.StatusOK, pageSaga, "sagas", v)
	return nil
}

// deadLetterScan bounds how many dead letters a saga's page looks through.
const deadLetterScan = 10_000

// sagaDeadLetters are the dead letters whose metadata names saga id,
// oldest first, from the oldest deadLetterScan (scannedAll false if there
// are more), each as a listing has it: a bounded part. unknown counts
// those whose metadata was too large to list, which may name it.
func (u *Handler) sagaDeadLetters(ctx context.Context, id uuid.UUID) (found []delivery.DeadLetter, scannedAll bool, unknown int, err error) {
	const page = 500
	var after int64
	for scanned := 0; scanned < deadLetterScan; scanned += page {
		list, err := u.client.DeadLetters(ctx, delivery.DeadLetterFilter{AfterID: after, Limit: page})
		if err != nil {
			return nil, false, 0, err
		}
		for _, d := range list {
			switch {
			case d.Metadata.Get(metadata.SagaID) == id.String():
				found = append(found, d)
			case metadataLeftOut(d):
				unknown++
			}
		}
		if len(list) < page {
			return found, true, unknown, nil
		}
		after = list[len(list)-1].ID
	}
	return found, false, unknown, nil
}

// metadataLeftOut reports whether a listing left d's metadata out for its
// size.
func metadataLeftOut(d delivery.DeadLetter) bool { return d.RawMetadata == nil && d.MetadataSize > 0 }

func kindClass(kind string) string {
	switch kind {
	case "reply_ok", "completed":
		return "good"
	case "reply_failed", "failed", "gave_up":
		return "bad"
	case "deadline", "resent", "cancelled", "retried":
		return "warn"
	case "compensated":
		return "undo"
	}
	return "plain"
}

func ms(d time.Duration) string {
	return strconv.FormatFloat(float64(d.Microseconds())/1000, 'f', 1, 64) + " ms"
}

// prettyJSON is raw indented, or as it is if it is not JSON (a page shows
// it printable).
func prettyJSON(raw []byte) string {
	if len(raw) == 0 {
		return ""
	}
	var buf bytes.Buffer
	if json.Indent(&buf, raw, "", "  ") == nil {
		return buf.String()
	}
	return string(raw)
}

// --- retry and cancel ----------------------------------------------------------

func (u *Handler) askRetry(w http.ResponseWriter, r *http.Request) error {
	return u.ask(w, r, saga.RequestRetry)
}

func (u *Handler) askCancel(w http.ResponseWriter, r *http.Request) error {
	return u.ask(w, r, saga.RequestCancel)
}

// ask makes the request `pgsaga retry` or `pgsaga cancel` makes, waits a
// moment for a worker to carry it out, and redirects to the saga's page,
// which shows the request's outcome, or that it is pending.
func (u *Handler) ask(w http.ResponseWriter, r *http.Request, kind saga.RequestKind) error {
	id, err := sagaID(r)
	if err != nil {
		return err
	}
	reason := ""
	if kind == saga.RequestCancel {
		reason = present.Clip(present.OneLine(r.PostFormValue("reason")), 500)
	}
	ctx, cancel := context.WithTimeout(r.Context(), pageTimeout+u.cfg.RequestWait)
	defer cancel()
	req, err := u.client.Ask(ctx, id, kind, reason)
	if errors.Is(err, saga.ErrNoSuchSaga) {
		u.redirect(w, r, "/sagas", flash{"error", fmt.Sprintf("No saga has the id %s: nothing was asked.", id)})
		return nil
	}
	if err != nil {
		return err
	}
	if req.DoneAt == nil {
		req, err = present.AwaitRequest(ctx, u.client, req, u.cfg.RequestWait)
		if err != nil {
			return err
		}
	}
	what := strings.ToUpper(string(kind[:1])) + string(kind[1:])
	var f flash
	switch {
	case req.DoneAt == nil:
		f = flash{"info", fmt.Sprintf("%s requested; no worker has carried it out yet (is a worker of this saga running?). This page refreshes until one does.", what)}
	case req.Outcome == saga.RequestRefused:
		f = flash{"error", fmt.Sprintf("%s refused: %s", what, req.Detail)}
	default:
		status := "?"
		if in, err := u.client.Get(ctx, id); err == nil {
			status = string(in.Status)
		}
		f = flash{"ok", fmt.Sprintf("%s done; the saga is %s.", what, status)}
	}
	u.redirect(w, r, "/sagas/"+id.String()+"?request="+req.ID.String(), f)
	return nil
}

// --- dead letters -------------------------------------------------------------

type deadLettersView struct {
	Topic    string
	Limit    int
	After    int64
	Topics   []string
	Rows     []deadLetterRow
	NextHref string
}

// deadLetterRow is a dead letter as the pages show it: in a listing, the
// bounded part a listing reads; on its own page, all of it but the
// payload's first pageShowBytes.
type deadLetterRow struct {
	ID                          int64
	UUID, Topic, Group, Handler string
	// Reason is as read (in a listing, cut: ReasonNote says so);
	// ReasonShort is its first line for a table, ReasonLong whether that
	// is not all of it.
	Reason, ReasonShort, ReasonNote string
	ReasonLong                      bool
	Attempts                        int
	Dead, DeadAt, PublishedAt       string
	IsReplayed                      bool
	Replayed, ReplayedAt            string
	// NotReplayable says why the dead letter cannot be replayed ("" if it
	// can).
	NotReplayable string
	// Payload is the part of the payload shown; PayloadShown says which
	// part ("N bytes", or "first n of N bytes"); PayloadSize is N.
	Payload, PayloadNote, PayloadShown, PayloadSize string
	Metadata                                        []keyValue
	MetadataNote                                    string
	SagaID, SagaShort, SagaHref                     string
	Anchor, Href, PayloadHref, ReplayAction, Return string
	// Consumer says who gave up on it: the group and its handler, or that
	// no group read the topic.
	Consumer string
}

type keyValue struct{ Key, Value string }

// pageShowBytes bounds the payload a dead letter's page shows; its
// download has all of it.
const pageShowBytes = 1 << 20

// deadLetterRowOf shows d with shown, the part of its payload a page shows;
// ret is the page its Replay button returns to.
func deadLetterRowOf(d delivery.DeadLetter, shown []byte, now time.Time, ret string) deadLetterRow {
	row := deadLetterRow{ID: d.ID, UUID: d.UUID, Topic: d.Topic, Group: present.Dash(d.ConsumerGroup), Handler: present.Dash(d.Handler),
		Reason: d.Reason, Attempts: d.Attempts, Dead: present.Age(now.Sub(d.DeadAt)) + " ago", DeadAt: stamp(d.DeadAt),
		PublishedAt: stamp(d.CreatedAt), IsReplayed: d.ReplayedAt != nil, PayloadSize: thousands(d.PayloadSize) + " bytes",
		Anchor: fmt.Sprintf("dl-%d", d.ID), Href: fmt.Sprintf("/dead-letters/%d", d.ID), Return: ret}
	row.PayloadHref, row.ReplayAction = row.Href+"/payload", row.Href+"/replay"
	row.ReasonShort = present.Clip(present.OneLine(row.Reason), 160)
	row.ReasonLong = row.ReasonShort != row.Reason
	if n := utf8.RuneCountInString(d.Reason); d.ReasonLength > n {
		row.ReasonNote = fmt.Sprintf("The first %s of %s characters: the dead letter's page has all of it.", thousands(n), thousands(d.ReasonLength))
	}
	if !d.Replayable() {
		row.NotReplayable = "arrived from a message broker and could not be queued here: it must be sent again"
	}
	row.PayloadShown = row.PayloadSize
	if len(shown) < d.PayloadSize {
		row.PayloadShown = "first " + thousands(len(shown)) + " of " + row.PayloadSize
		shown = wholeRunes(shown)
		row.Payload = string(shown)
	} else {
		row.Payload = prettyJSON(shown)
	}
	// Printable here, not only once the page is made: html/template would
	// make a NUL U+FFFD first.
	row.Payload = printable(row.Payload)
	var notes []string
	if !termsafe.Clean(string(shown)) {
		notes = append(notes, `control characters and bytes that are not UTF-8 text are shown as \x00, \x1b, \xff and the like`)
	}
	row.PayloadNote = strings.Join(notes, "; ")
	if d.ReplayedAt != nil {
		row.Replayed, row.ReplayedAt = present.Age(now.Sub(*d.ReplayedAt))+" ago", stamp(*d.ReplayedAt)
	}
	switch {
	case metadataLeftOut(d):
		row.MetadataNote = fmt.Sprintf("%s bytes, too many to list: the dead letter's page shows them.", thousands(d.MetadataSize))
	case d.Metadata == nil && len(d.RawMetadata) > 0 && string(d.RawMetadata) != "null":
		row.MetadataNote = "not a JSON object of strings: " + string(d.RawMetadata)
	}
	for _, k := range slices.Sorted(maps.Keys(d.Metadata)) {
		row.Metadata = append(row.Metadata, keyValue{k, d.Metadata[k]})
	}
	if id, err := uuid.Parse(d.Metadata.Get(metadata.SagaID)); err == nil {
		row.SagaID, row.SagaShort, row.SagaHref = id.String(), id.String()[:8]+"…", "/sagas/"+id.String()
	}
	switch {
	case d.ConsumerGroup == "":
		row.Consumer = "no consumer group read the topic"
	case d.Handler == "" || d.Handler == d.ConsumerGroup:
		row.Consumer = "group " + d.ConsumerGroup
	default:
		row.Consumer = "group " + d.ConsumerGroup + " · handler " + d.Handler
	}
	return row
}

// wholeRunes is b without the start of a character its cut left at its
// end.
func wholeRunes(b []byte) []byte {
	for i := 1; i <= utf8.UTFMax && i <= len(b); i++ {
		if utf8.RuneStart(b[len(b)-i]) {
			if !utf8.FullRune(b[len(b)-i:]) {
				return b[:len(b)-i]
			}
			break
		}
	}
	return b
}

// thousands is n with its thousands set apart: 5,242,880.
func thousands(n int) string {
	s := strconv.Itoa(n)
	if n < 0 {
		return "-" + thousands(-n)
	}
	for i := len(s) - 3; i > 0; i -= 3 {
		s = s[:i] + "," + s[i:]
	}
	return s
}

func (u *Handler) deadLetters(w http.ResponseWriter, r *http.Request) error {
	ctx, cancel := context.WithTimeout(r.Context(), pageTimeout)
	defer cancel()
	q := r.URL.Query()
	v := deadLettersView{Topic: strings.TrimSpace(q.Get("topic")), Limit: 100}
	if s := strings.TrimSpace(q.Get("limit")); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil {
			return badRequest("Bad filter: limit %q is not a whole number.", s)
		}
		v.Limit = n
	}
	if err := present.LimitError(v.Limit); err != nil {
		return badRequest("Bad filter: %v.", err)
	}
	if s := strings.TrimSpace(q.Get("after")); s != "" {
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil || n < 0 {
			return badRequest("Bad filter: after %q is not a dead letter id (a whole number, 0 or more).", s)
		}
		v.After = n
	}
	list, err := u.client.DeadLetters(ctx, delivery.DeadLetterFilter{Topic: v.Topic, AfterID: v.After, Limit: v.Limit})
	if err != nil {
		return err
	}
	groups, err := u.client.ConsumerGroups(ctx)
	if err != nil {
		return err
	}
	for _, g := range groups {
		if !slices.Contains(v.Topics, g.Topic) {
			v.Topics = append(v.Topics, g.Topic)
		}
	}
	for _, d := range list {
		v.Rows = append(v.Rows, deadLetterRowOf(d, d.PayloadPreview, present.DeadLetterNow(d), r.URL.RequestURI()))
	}
	if len(list) == v.Limit {
		next := url.Values{"after": {strconv.FormatInt(list[len(list)-1].ID, 10)}, "limit": {strconv.Itoa(v.Limit)}}
		if v.Topic != "" {
			next.Set("topic", v.Topic)
		}
		v.NextHref = "/dead-letters?" + next.Encode()
	}
	u.render(w, r, http.StatusOK, pageDeadLetters, "dead-letters", v)
	return nil
}

// deadLetterID is the dead letter id in the request's path, or a 400.
func deadLetterID(r *http.Request) (int64, error) {
	raw := r.PathValue("id")
	id, err := strconv.ParseInt(raw, 10, 64)
	if err != nil || id < 1 {
		return 0, badRequest("%q is not a dead letter id: the ids are positive whole numbers, as the Dead letters page lists them.", raw)
	}
	return id, nil
}

// wholeDeadLetter reads the dead letter the request's path names, whole:
// the only page that reads a whole payload.
func (u *Handler) wholeDeadLetter(r *http.Request) (delivery.DeadLetter, error) {
	id, err := deadLetterID(r)
	if err != nil {
		return delivery.DeadLetter{}, err
	}
	ctx, cancel := context.WithTimeout(r.Context(), pageTimeout)
	defer cancel()
	d, err := u.client.DeadLetter(ctx, id)
	if errors.Is(err, delivery.ErrNoSuchDeadLetter) {
		return d, notFound("No dead letter has the id %d in this database.", id)
	}
	return d, err
}

// deadLetterView is one dead letter's page.
type deadLetterView struct{ deadLetterRow }

func (v deadLetterView) title() string { return fmt.Sprintf("Dead letter %d", v.ID) }

// deadLetter is a dead letter's page: all of it, the payload's first
// pageShowBytes, its Replay button.
func (u *Handler) deadLetter(w http.ResponseWriter, r *http.Request) error {
	d, err := u.wholeDeadLetter(r)
	if err != nil {
		return err
	}
	row := deadLetterRowOf(d, d.Payload[:min(len(d.Payload), pageShowBytes)], present.DeadLetterNow(d), r.URL.Path)
	u.render(w, r, http.StatusOK, pageDeadLetter, "dead-letters", deadLetterView{row})
	return nil
}

// deadLetterPayload is a dead letter's payload, byte for byte, as a file
// to save, never a page to show.
func (u *Handler) deadLetterPayload(w http.ResponseWriter, r *http.Request) error {
	d, err := u.wholeDeadLetter(r)
	if err != nil {
		return err
	}
	h := w.Header()
	h.Set("Content-Type", "application/octet-stream")
	h.Set("Content-Disposition", fmt.Sprintf(`attachment; filename="dead-letter-%d.bin"`, d.ID))
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Content-Length", strconv.Itoa(len(d.Payload)))
	_, _ = w.Write(d.Payload)
	return nil
}

// replay is `pgsaga dead-letters replay <id>` for one dead letter.
func (u *Handler) replay(w http.ResponseWriter, r *http.Request) error {
	id, err := deadLetterID(r)
	if err != nil {
		return err
	}
	back := localPath(r.PostFormValue("return"), "/dead-letters")
	back = strings.SplitN(back, "#", 2)[0] + fmt.Sprintf("#dl-%d", id)
	done, err := present.ReplayDeadLetter(r.Context(), u.client, id)
	switch {
	case err == nil:
		u.redirect(w, r, back, flash{"ok", strings.ToUpper(done[:1]) + done[1:] + "."})
	case errors.Is(err, delivery.ErrNoSuchDeadLetter):
		u.redirect(w, r, back, flash{"error", fmt.Sprintf("No dead letter has the id %d: nothing was replayed.", id)})
	case errors.Is(err, delivery.ErrAlreadyReplayed), errors.Is(err, delivery.ErrTopicNotSubscribed), errors.Is(err, delivery.ErrNotReplayable):
		u.redirect(w, r, back, flash{"error", fmt.Sprintf("Dead letter %d not replayed: %s.", id, strings.TrimPrefix(err.Error(), "transport: "))})
	default:
		return err
	}
	return nil
}

// --- consumer groups --------------------------------------------------------

type consumersView struct {
	Stale                                 string
	Rows                                  []groupRow
	Groups, Waiting, Retrying, NotRunning int
	Topics                                int
}

type groupRow struct {
	Topic, Group                 string
	Waiting, Retrying, Later     int
	Oldest, LastSeen, LastSeenAt string
	State, StateClass            string
}

func (u *Handler) consumers(w http.ResponseWriter, r *http.Request) error {
	ctx, cancel := context.WithTimeout(r.Context(), pageTimeout)
	defer cancel()
	stale := 2 * time.Minute
	v := consumersView{Stale: "2m"}
	if s := strings.TrimSpace(r.URL.Query().Get("stale")); s != "" {
		d, err := time.ParseDuration(s)
		if err != nil || d <= 0 {
			return badRequest("Bad filter: stale %q is not a positive duration; write it like 90s, 2m or 1h.", s)
		}
		stale, v.Stale = d, s
	}
	groups, err := u.client.ConsumerGroups(ctx)
	if err != nil {
		return err
	}
	topics := map[string]bool{}
	for _, g := range groups {
		now := g.ReadAt // ages by the database's clock
		row := groupRow{Topic: g.Topic, Group: g.ConsumerGroup, Waiting: g.Waiting, Retrying: g.Retrying, Later: g.NotYetAvailable,
			Oldest: "-", LastSeen: "never"}
		if g.Oldest != nil {
			row.Oldest = present.Age(now.Sub(*g.Oldest))
		}
		switch {
		case g.Running(stale):
			row.State, row.StateClass = "running", "good"
		case g.LastSeen != nil:
			row.State, row.StateClass = "stale", "bad"
		default:
			row.State, row.StateClass = "never ran", "bad"
		}
		if g.LastSeen != nil {
			row.LastSeen, row.LastSeenAt = present.Age(now.Sub(*g.LastSeen))+" ago", stamp(*g.LastSeen)
		}
		v.Rows = append(v.Rows, row)
		v.Groups++
		v.Waiting += g.Waiting
		v.Retrying += g.Retrying
		if row.StateClass != "good" {
			v.NotRunning++
		}
		topics[g.Topic] = true
	}
	v.Topics = len(topics)
	u.render(w, r, http.StatusOK, pageConsumers, "consumers", v)
	return nil
}
